"""The CPU attention backend ("torch"): the math of attention_ref on a head-major KV cache,
tuned for decode batches.

Layout, per layer: k_cache, v_cache of shape [num_kv_heads, num_blocks, block_size, head_dim],
so a request's context for one kv head is a list of contiguous [block_size, head_dim] tiles.

Decode (q_len == 1), the hot path, runs one of two ways:
 * the C++ kernel of csrc/cpu_kernels.cpp (float32, AVX-512 / AVX2; kernels.cpu_kernels): one
   call per layer covers every decode request, reading each K/V tile in place, once, for the
   G query heads of its kv head; no gather, no padding;
 * otherwise pure torch: requests sorted by context length and cut into a few buckets, each
   padded only to its own longest context; per bucket, K and V are gathered head-major from
   the flat [num_kv_heads * num_blocks, block_size, head_dim] view straight into the layout of
   a batched matmul ([Hkv * B, C, D], reused workspace buffers), and attention is two bmm
   calls with the G query heads of a kv head as the rows (GQA without repeating K/V).
Prefill chunks (q_len > 1) go one request at a time through SDPA over their own gathered
blocks: is_causal when the chunk starts the prompt, else a causal mask offset by the context.

A layer with a sliding window, a logit softcap or attention sinks (attention_ref's module doc)
takes a plain per-request path instead (`_attend_explicit`: scores, mask and softmax written
out), never the C++ kernel.

Whether the C++ kernels run is decided once, at load (`use_kernel`, from the LayerConfig);
a shape the kernel is not built for, and an fp8 cache (kernels.kv_quant: read as q's dtype,
k_scale folded into the softmax scale, v_scale into the output), take the pure-torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.kernels.attention_metadata import AttentionMetadata, cdiv
from pagedserve.kernels.attention_ref import real_rows, softmax_with_sinks
from pagedserve.kernels.kv_quant import is_fp8, raw, to_cache_values
from pagedserve.kernels.workspace import Workspace

_WORKSPACE = Workspace()

# Fixed cost of one more decode bucket (torch path), in gathered (request x block) pairs.
DECODE_BUCKET_OVERHEAD_BLOCKS = 48


@dataclass
class DecodeBucket:
    """Decode requests attended together (torch path), padded to num_blocks blocks."""

    tokens: slice | torch.Tensor  # their token rows (a slice when contiguous)
    size: int
    num_blocks: int
    block_ids: torch.Tensor  # [num_kv_heads * size * num_blocks] rows of the flat cache view
    mask: torch.Tensor | None  # [size, 1, C] additive (0 / -inf); None: no padding


@dataclass
class DecodeRequests:
    """The step's decode requests, as the C++ kernel takes them."""

    rows: torch.Tensor  # [B] int64 token row of each
    seq_lens: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, W] int32, contiguous


@dataclass
class PrefillChunk:
    """One request with q_len > 1: tokens [start, end) after ctx = seq_len - q_len earlier."""

    start: int
    end: int
    seq_len: int
    num_blocks: int
    block_ids: torch.Tensor  # [num_kv_heads * num_blocks] rows of the flat cache view
    mask: torch.Tensor | None  # [q_len, seq_len] bool (None: plain causal, ctx == 0)


@dataclass
class HeadMajorPlan:
    decode: DecodeRequests | None
    buckets: list[DecodeBucket] | None  # built for the torch path only
    prefill: list[PrefillChunk]


def _split_decodes(num_blocks: list[int], overhead: int) -> list[int]:
    """Cut points of a list sorted descending: a new bucket starts at i when padding every
    remaining request to the current bucket's length would waste more than `overhead`."""
    if not num_blocks:
        return [0]
    cuts = [0]
    head = num_blocks[0]
    remaining = len(num_blocks)
    for i, blocks in enumerate(num_blocks):
        if (head - blocks) * (remaining - i) > overhead:
            cuts.append(i)
            head = blocks
    cuts.append(len(num_blocks))
    return cuts


def _decode_buckets(
    metadata: AttentionMetadata, num_kv_heads: int, num_blocks: int, dtype: torch.dtype
) -> list[DecodeBucket]:
    block_size = metadata.block_size
    query_lens = metadata.query_lens_cpu.tolist()
    seq_lens = metadata.seq_lens_cpu.tolist()
    starts = (torch.cumsum(metadata.query_lens_cpu, 0) - metadata.query_lens_cpu).tolist()
    device = metadata.slot_mapping.device
    head_offsets = torch.arange(num_kv_heads, dtype=torch.int64) * num_blocks
    decodes = [i for i, q_len in enumerate(query_lens) if q_len == 1]
    decodes.sort(key=lambda i: -seq_lens[i])
    decode_blocks = [cdiv(seq_lens[i], block_size) for i in decodes]
    cuts = _split_decodes(decode_blocks, DECODE_BUCKET_OVERHEAD_BLOCKS)
    buckets = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        rows = decodes[lo:hi]
        width = decode_blocks[lo]
        table = metadata.block_tables_cpu[torch.tensor(rows), :width].to(torch.int64)
        block_ids = (head_offsets[:, None, None] + table[None]).reshape(-1)
        lens = torch.tensor([seq_lens[i] for i in rows])
        mask = None
        if int(lens.min()) < width * block_size:
            padding = torch.arange(width * block_size)[None, :] >= lens[:, None]
            mask = torch.zeros(len(rows), 1, width * block_size, dtype=dtype)
            mask = mask.masked_fill_(padding.unsqueeze(1), float("-inf")).to(device)
        token_rows = [starts[i] for i in rows]
        if token_rows == list(range(token_rows[0], token_rows[0] + len(rows))):
            tokens: slice | torch.Tensor = slice(token_rows[0], token_rows[0] + len(rows))
        else:
            tokens = torch.tensor(token_rows, device=device)
        buckets.append(DecodeBucket(tokens, len(rows), width, block_ids.to(device), mask))
    return buckets


def build_head_major_plan(
    metadata: AttentionMetadata,
    num_kv_heads: int,
    num_blocks: int,
    dtype: torch.dtype,
    with_buckets: bool,
) -> HeadMajorPlan:
    query_lens = metadata.query_lens_cpu
    device = metadata.slot_mapping.device
    is_decode = query_lens == 1
    decode = None
    num_decodes = int(is_decode.sum())
    if num_decodes:
        if num_decodes == len(query_lens):
            rows = torch.arange(num_decodes)
            seq_lens, tables = metadata.seq_lens_cpu, metadata.block_tables_cpu
        else:
            index = is_decode.nonzero().squeeze(1)
            rows = (torch.cumsum(query_lens, 0) - query_lens)[index]
            seq_lens, tables = metadata.seq_lens_cpu[index], metadata.block_tables_cpu[index]
        decode = DecodeRequests(
            rows.to(device),
            seq_lens.to(device, torch.int64),
            tables.to(device, torch.int32).contiguous(),
        )
    buckets = None
    if num_decodes and with_buckets:
        buckets = _decode_buckets(metadata, num_kv_heads, num_blocks, dtype)
    prefill = []
    if num_decodes < len(query_lens):
        block_size = metadata.block_size
        head_offsets = torch.arange(num_kv_heads, dtype=torch.int64) * num_blocks
        start = 0
        for i, (q_len, seq_len) in enumerate(
            zip(query_lens.tolist(), metadata.seq_lens_cpu.tolist())
        ):
            if q_len > 1:
                width = cdiv(seq_len, block_size)
                table = metadata.block_tables_cpu[i, :width].to(torch.int64)
                block_ids = (head_offsets[:, None] + table[None]).reshape(-1).to(device)
                ctx, mask = seq_len - q_len, None
                if ctx:
                    mask = torch.arange(seq_len)[None, :] <= (ctx + torch.arange(q_len))[:, None]
                    mask = mask.to(device)
                prefill.append(PrefillChunk(start, start + q_len, seq_len, width, block_ids, mask))
            start += q_len
    return HeadMajorPlan(decode, buckets, prefill)


def head_major_plan(
    metadata: AttentionMetadata,
    num_kv_heads: int,
    num_blocks: int,
    dtype: torch.dtype,
    with_buckets: bool,
) -> HeadMajorPlan:
    """The step's plan, built on first use and shared by every layer."""
    key = ("torch", num_kv_heads, num_blocks, dtype, with_buckets)
    return metadata.plan(
        key,
        lambda: build_head_major_plan(metadata, num_kv_heads, num_blocks, dtype, with_buckets),
    )


def write_kv_cache_head_major(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    use_kernel: bool = False,
) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim] (any strides); caches [num_kv_heads,
    num_blocks, block_size, head_dim]: cache[h].flat[slot_mapping[i]] = k[i, h] (and v; fp8
    caches: divided by the scale and rounded). use_kernel: the C++ kernel (loaded) takes
    float32 CPU rows into a float32 cache."""
    if (
        use_kernel
        and k.device.type == "cpu"
        and k.dtype == k_cache.dtype == torch.float32
        and k.stride(-1) == 1
        and v.stride(-1) == 1
        and slot_mapping.dtype == torch.int64
    ):
        torch.ops.pagedserve_cpu.write_kv_head_major(k, v, k_cache, v_cache, slot_mapping)
        return
    k, v, slot_mapping = real_rows(k, v, slot_mapping)
    k, v = to_cache_values(k, k_cache, k_scale), to_cache_values(v, v_cache, v_scale)
    num_kv_heads, _, _, head_dim = k_cache.shape
    for cache, new in ((k_cache, k), (v_cache, v)):
        rows = raw(new).transpose(0, 1)  # [num_kv_heads, num_tokens, head_dim]
        raw(cache).view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, rows)


def paged_attention_head_major(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    use_kernel: bool = False,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] (any strides) -> [num_tokens, num_heads, head_dim];
    head-major caches. window, softcap: the layer's sliding window and logit softcap (0:
    none); sinks: its float32 sink logits, [num_heads] (None: none). use_kernel: the C++ decode
    kernel (loaded) takes the decode rows of the shapes it is built for (float32 caches) when
    the layer has none of the three."""
    num_kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    scale *= k_scale
    if window or softcap or sinks is not None:
        out = _attend_explicit(q, k_cache, v_cache, metadata, scale, window, softcap, sinks)
        return out if v_scale == 1.0 else out.mul_(v_scale)
    use_kernel = use_kernel and not is_fp8(k_cache) and cpu_decode_kernel_applies(q, num_kv_heads)
    plan = head_major_plan(metadata, num_kv_heads, num_blocks, q.dtype, not use_kernel)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if plan.decode is not None and use_kernel:
        decode = plan.decode
        torch.ops.pagedserve_cpu.paged_decode(
            out, q, k_cache, v_cache, decode.block_tables, decode.seq_lens, decode.rows, scale
        )
    elif plan.buckets:
        k_rows = k_cache.view(num_kv_heads * num_blocks, block_size, head_dim)
        v_rows = v_cache.view(num_kv_heads * num_blocks, block_size, head_dim)
        for bucket in plan.buckets:
            _decode_bucket(q, k_rows, v_rows, out, bucket, num_kv_heads, block_size, scale)
    if plan.prefill:
        k_rows = k_cache.view(num_kv_heads * num_blocks, block_size, head_dim)
        v_rows = v_cache.view(num_kv_heads * num_blocks, block_size, head_dim)
        for chunk in plan.prefill:
            _prefill_chunk(q, k_rows, v_rows, out, chunk, num_kv_heads, block_size, scale)
    return out if v_scale == 1.0 else out.mul_(v_scale)


def _gather_blocks(
    rows: torch.Tensor, block_ids: torch.Tensor, buffer: str, dtype: torch.dtype
) -> torch.Tensor:
    """rows[block_ids] as `dtype`: into a workspace buffer, or converted from an fp8 cache."""
    if is_fp8(rows):
        return rows.index_select(0, block_ids).to(dtype)
    out = _WORKSPACE.get(buffer, (len(block_ids), *rows.shape[1:]), dtype, rows.device)
    return torch.index_select(rows, 0, block_ids, out=out)


def _decode_bucket(
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    out: torch.Tensor,
    bucket: DecodeBucket,
    num_kv_heads: int,
    block_size: int,
    scale: float,
) -> None:
    _, num_heads, head_dim = q.shape
    batch, group = bucket.size, num_heads // num_kv_heads
    rows = num_kv_heads * batch
    ctx = bucket.num_blocks * block_size
    dtype, device = q.dtype, q.device
    sliced = isinstance(bucket.tokens, slice)
    queries = q[bucket.tokens] if sliced else q.index_select(0, bucket.tokens)
    q_t = _WORKSPACE.get("q", (num_kv_heads, batch, group, head_dim), dtype, device)
    torch.mul(queries.view(batch, num_kv_heads, group, head_dim).transpose(0, 1), scale, out=q_t)
    keys = _gather_blocks(k_rows, bucket.block_ids, "keys", dtype)
    scores = _WORKSPACE.get("scores", (rows, group, ctx), dtype, device)
    torch.bmm(q_t.view(rows, group, head_dim), keys.view(rows, ctx, head_dim).mT, out=scores)
    if bucket.mask is not None:
        scores.view(num_kv_heads, batch, group, ctx).add_(bucket.mask)
    probs = torch.softmax(scores, dim=-1)
    values = _gather_blocks(v_rows, bucket.block_ids, "values", dtype)
    result = _WORKSPACE.get("out", (num_kv_heads, batch, group, head_dim), dtype, device)
    torch.bmm(probs, values.view(rows, ctx, head_dim), out=result.view(rows, group, head_dim))
    result = result.transpose(0, 1)  # [B, Hkv, G, D]
    if sliced:
        out[bucket.tokens].view(batch, num_kv_heads, group, head_dim).copy_(result)
    else:
        out.index_copy_(0, bucket.tokens, result.reshape(batch, num_heads, head_dim))


def _prefill_chunk(
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    out: torch.Tensor,
    chunk: PrefillChunk,
    num_kv_heads: int,
    block_size: int,
    scale: float,
) -> None:
    head_dim = q.shape[-1]
    shape = (num_kv_heads, chunk.num_blocks * block_size, head_dim)
    keys = k_rows.index_select(0, chunk.block_ids).view(shape)[:, : chunk.seq_len].to(q.dtype)
    values = v_rows.index_select(0, chunk.block_ids).view(shape)[:, : chunk.seq_len].to(q.dtype)
    queries = q[chunk.start : chunk.end].transpose(0, 1)  # [H, L, D]
    result = F.scaled_dot_product_attention(
        queries.unsqueeze(0),
        keys.unsqueeze(0),
        values.unsqueeze(0),
        attn_mask=chunk.mask,
        is_causal=chunk.mask is None,
        scale=scale,
        enable_gqa=True,
    )
    out[chunk.start : chunk.end].copy_(result[0].transpose(0, 1))


@dataclass
class ExplicitRequest:
    """One request of the explicit path: tokens [start, end), its cache rows and the keys each
    of its queries attends (`_attend_explicit`)."""

    start: int
    end: int
    seq_len: int
    block_ids: torch.Tensor  # [num_kv_heads * num_blocks] rows of the flat cache view
    allowed: torch.Tensor  # [q_len, seq_len] bool


def explicit_plan(
    metadata: AttentionMetadata, num_kv_heads: int, num_blocks: int, window: int
) -> list[ExplicitRequest]:
    """The step's requests for the explicit path with this window, built on first use and
    shared by every layer of the window: query i of a request (position p = ctx + i) attends
    keys j <= p, and j > p - window when window > 0."""
    key = ("explicit", num_kv_heads, num_blocks, window)
    return metadata.plan(
        key, lambda: _build_explicit_plan(metadata, num_kv_heads, num_blocks, window)
    )


def _build_explicit_plan(
    metadata: AttentionMetadata, num_kv_heads: int, num_blocks: int, window: int
) -> list[ExplicitRequest]:
    device = metadata.slot_mapping.device
    head_offsets = torch.arange(num_kv_heads, dtype=torch.int64) * num_blocks
    plan, start = [], 0
    lens = zip(metadata.query_lens_cpu.tolist(), metadata.seq_lens_cpu.tolist())
    for i, (q_len, seq_len) in enumerate(lens):
        table = metadata.block_tables_cpu[i, : cdiv(seq_len, metadata.block_size)].to(torch.int64)
        block_ids = (head_offsets[:, None] + table[None]).reshape(-1).to(device)
        positions = seq_len - q_len + torch.arange(q_len)[:, None]
        keys = torch.arange(seq_len)[None, :]
        allowed = keys <= positions
        if window:
            allowed &= keys > positions - window
        plan.append(ExplicitRequest(start, start + q_len, seq_len, block_ids, allowed.to(device)))
        start += q_len
    return plan


def _attend_explicit(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Every request on its own (explicit_plan), scores in float32; softcap c > 0 maps each
    score s to c tanh(s / c); sinks [num_heads] join each head's softmax denominator
    (attention_ref.softmax_with_sinks)."""
    num_kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    k_rows = k_cache.view(num_kv_heads * num_blocks, block_size, head_dim)
    v_rows = v_cache.view(num_kv_heads * num_blocks, block_size, head_dim)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    sink_logits = None if sinks is None else sinks.view(-1, 1, 1)
    for request in explicit_plan(metadata, num_kv_heads, num_blocks, window):
        shape = (num_kv_heads, -1, head_dim)
        keys = k_rows.index_select(0, request.block_ids).view(shape)[:, : request.seq_len]
        values = v_rows.index_select(0, request.block_ids).view(shape)[:, : request.seq_len]
        keys = keys.float().repeat_interleave(group, dim=0)
        values = values.float().repeat_interleave(group, dim=0)
        queries = q[request.start : request.end].float().transpose(0, 1)  # [H, L, D]
        scores = queries @ keys.transpose(1, 2) * scale  # [H, L, S]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~request.allowed, float("-inf"))
        result = softmax_with_sinks(scores, sink_logits) @ values  # [H, L, D]
        out[request.start : request.end].copy_(result.transpose(0, 1))
    return out


def cpu_decode_kernel_applies(q: torch.Tensor, num_kv_heads: int) -> bool:
    """Whether the C++ decode kernel is built for q's decode rows (float32 CPU rows, head_dim
    16, 32, 64 or 128, 1, 2, 4 or 8 query heads per kv head)."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and q.shape[-1] in (16, 32, 64, 128)
        and q.stride(-1) == 1
        and q.shape[1] % num_kv_heads == 0
        and q.shape[1] // num_kv_heads in (1, 2, 4, 8)
    )
