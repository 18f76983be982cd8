"""Paged attention: the per-step metadata, the pure-torch reference and the CPU backend.

Backends (ATTENTION_BACKENDS / KV_CACHE_WRITERS, by name):
  * "torch_ref": the reference below (`paged_attention`, `write_kv_cache`), token-major cache;
    the Triton / CUDA kernels are checked against it.
  * "torch": the CPU backend (further down): a head-major cache, a C++ decode kernel (built on
    first use; pure torch when it cannot be) and per-request SDPA for prefill chunks.
  * "triton", "cuda": in their own modules, token-major.
KV_CACHE_LAYOUTS gives each backend's per-layer cache layout; `kv_cache_layer_shape` the shape.

Token-major KV cache, per layer: `k_cache`, `v_cache` of shape
[num_blocks, block_size, num_kv_heads, head_dim].
Token t of a request lives at slot = block_table[t // block_size] * block_size + t % block_size;
`slot_mapping[i]` is the slot of the i-th token of the step (the flattened batch).

Math. A step holds a batch of requests, each with q_len >= 1 new tokens (a prefill chunk or one
decode token) laid out back to back in `q` ([num_tokens, num_heads, head_dim]). Request b has
seq_len_b tokens in context once this step's keys are written (new ones included), so its first
new token sits at position ctx_b = seq_len_b - q_len_b. With G = num_heads / num_kv_heads (GQA),
query i of request b, head h, reads kv head h // G over keys j = 0 .. ctx_b + i (causal):

    s_j = scale * <q[b, i, h], K[b, j, h // G]>
    out[b, i, h] = sum_j softmax_j(s) * V[b, j, h // G]

Vectorised form. Decode requests (q_len == 1, the hot path) form one group; prefill chunks
(q_len > 1) are bucketed by context length so that padding stays within PADDING_WASTE_LIMIT
of the real work. Each group is padded to [B, Q] queries and [B, C] keys, C = max_num_blocks *
block_size; keys and values are gathered block by block through the group's block table, and
one scaled_dot_product_attention call covers the group with the additive mask

    mask[b, i, j] = 0 if j <= ctx_b + min(i, q_len_b - 1) else -inf

(causal inside the chunk, and the length mask j < seq_len_b; padded query rows repeat the last
real row and their outputs are dropped). Decode folds the G query heads of a kv head into the
query rows ([B, Hkv, G, D] against [B, Hkv, C, D]); prefill uses SDPA's enable_gqa, and a lone
prompt with no earlier context uses is_causal instead of a mask. The groups are built once per
step and shared by every layer; `write_kv_cache` must run before `paged_attention` in a layer.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


PADDING_WASTE_LIMIT = 1.5  # a prefill bucket's padded area <= this x its real q_len * seq_len


@dataclass
class AttentionGroup:
    """Requests attended together: [batch, max_query_len] queries x [batch, max_ctx] keys."""

    query_index: torch.Tensor  # [B, Q] int64: token row of each query (pads repeat the last)
    block_ids: torch.Tensor  # [B * num_blocks] int64: each request's blocks, padded
    num_blocks: int
    key_mask: torch.Tensor  # [B, Q, C] bool: query (b, i) may attend key j
    output_rows: torch.Tensor | None  # [n] flat positions in B*Q that are real (None: all)
    output_tokens: torch.Tensor  # [n] token rows receiving them
    is_whole_batch: bool  # output_tokens == arange(num_tokens): no scatter needed
    causal_len: int | None = None  # one prompt with no earlier context: is_causal over this
    _masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    @property
    def is_decode(self) -> bool:
        return self.query_index.shape[1] == 1

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, Q, C] float mask: 0 where key_mask is set, -inf elsewhere."""
        if dtype not in self._masks:
            mask = torch.zeros(self.key_mask.shape, dtype=dtype, device=self.key_mask.device)
            self._masks[dtype] = mask.masked_fill_(~self.key_mask, float("-inf")).unsqueeze(1)
        return self._masks[dtype]


@dataclass
class OutputRows:
    """The token rows whose final hidden states the step needs (its logits rows) and a
    decode-style metadata attending each of them alone over its full context: the model's
    last layer then runs attention, o_proj and the MLP for these rows only."""

    indices: torch.Tensor  # [n] int64 token rows, device
    metadata: AttentionMetadata  # n one-token requests


@dataclass
class AttentionMetadata:
    """Everything an attention backend needs for one step (shared by all layers)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, device
    query_start_loc: torch.Tensor  # [batch + 1] int32, device
    seq_lens: torch.Tensor  # [batch] int32, device
    block_tables: torch.Tensor  # [batch, max_num_blocks] int32, device
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_lens_cpu: torch.Tensor  # [batch] int64
    seq_lens_cpu: torch.Tensor  # [batch] int64
    block_tables_cpu: torch.Tensor  # [batch, max_num_blocks] int32
    backend: str = "torch"
    output_rows: OutputRows | None = None  # None: every row's hidden state is needed
    _torch_groups: list[AttentionGroup] | None = None
    _plans: dict = field(default_factory=dict)  # backend plans, built once per step

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    def torch_groups(self) -> list[AttentionGroup]:
        """The torch reference's padded groups, built on first use and cached for the step."""
        if self._torch_groups is None:
            decode = self.query_lens_cpu == 1
            decode_rows = decode.nonzero().squeeze(1)
            prefill_rows = (~decode).nonzero().squeeze(1)
            buckets = [decode_rows] if len(decode_rows) else []
            if len(prefill_rows):
                buckets += self._bucket_prefills(prefill_rows)
            self._torch_groups = [self._build_group(rows) for rows in buckets]
        return self._torch_groups

    def _bucket_prefills(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Rows by context length, longest first, cut where a bucket's padded area
        B * max_q * max_ctx would exceed PADDING_WASTE_LIMIT x its real area."""
        order = rows[torch.argsort(self.seq_lens_cpu[rows], descending=True, stable=True)]
        query_lens, seq_lens = (
            self.query_lens_cpu[order].tolist(),
            self.seq_lens_cpu[order].tolist(),
        )
        buckets: list[list[int]] = []
        current: list[int] = []
        max_q = max_ctx = area = 0
        for row, q_len, seq_len in zip(order.tolist(), query_lens, seq_lens):
            new_q, new_ctx = max(max_q, q_len), max(max_ctx, seq_len)
            padded = (len(current) + 1) * new_q * new_ctx
            if current and padded > PADDING_WASTE_LIMIT * (area + q_len * seq_len):
                buckets.append(current)
                current, new_q, new_ctx, area = [], q_len, seq_len, 0
            current.append(row)
            max_q, max_ctx, area = new_q, new_ctx, area + q_len * seq_len
        buckets.append(current)
        return [torch.tensor(bucket) for bucket in buckets]

    def _build_group(self, rows: torch.Tensor) -> AttentionGroup:
        query_lens, seq_lens = self.query_lens_cpu[rows], self.seq_lens_cpu[rows]
        starts = torch.cumsum(self.query_lens_cpu, 0)[rows] - query_lens
        max_query_len = int(query_lens.max())
        num_blocks = cdiv(int(seq_lens.max()), self.block_size)
        offsets = torch.arange(max_query_len)
        query_pos = torch.minimum(offsets[None, :], (query_lens - 1)[:, None])  # [B, Q]
        query_index = starts[:, None] + query_pos
        key_limit = (seq_lens - query_lens)[:, None] + query_pos
        key_mask = torch.arange(num_blocks * self.block_size)[None, None, :] <= key_limit[..., None]
        block_ids = self.block_tables_cpu[rows, :num_blocks].reshape(-1).long()
        output_rows = None
        output_tokens = query_index.reshape(-1)
        if max_query_len > 1:
            output_rows = (offsets[None, :] < query_lens[:, None]).reshape(-1).nonzero().squeeze(1)
            output_tokens = output_tokens[output_rows]
        no_padding = len(rows) * max_query_len == self.num_tokens
        whole = no_padding and bool((output_tokens == torch.arange(self.num_tokens)).all())
        causal_len = None
        if len(rows) == 1 and int(query_lens[0]) == int(seq_lens[0]) > 1:
            causal_len = int(seq_lens[0])
        device = self.slot_mapping.device
        return AttentionGroup(
            query_index=query_index.to(device),
            block_ids=block_ids.to(device),
            num_blocks=num_blocks,
            key_mask=key_mask.to(device),
            output_rows=None if output_rows is None else output_rows.to(device),
            output_tokens=output_tokens.to(device),
            is_whole_batch=whole,
            causal_len=causal_len,
        )


def build_attention_metadata(
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    device: torch.device,
    backend: str = "torch",
) -> AttentionMetadata:
    """From CPU tensors: query_lens/seq_lens [B] int64, block_tables [B, W] int32 (W blocks
    cover the longest context), slot_mapping [num_tokens] int64."""
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    torch.cumsum(query_lens, 0, out=query_start_loc[1:])
    non_blocking = device.type == "cuda"
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device, non_blocking=non_blocking),
        query_start_loc=query_start_loc.to(device, non_blocking=non_blocking),
        seq_lens=seq_lens.to(torch.int32).to(device, non_blocking=non_blocking),
        block_tables=block_tables.to(device, non_blocking=non_blocking),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_size=block_size,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        block_tables_cpu=block_tables,
        backend=backend,
    )


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]; cache[slot_mapping[i]] = k[i] (and v)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] -> the same shape (see the module doc)."""
    groups = metadata.torch_groups()
    if len(groups) == 1 and groups[0].is_whole_batch:
        return _attend_group(q, k_cache, v_cache, groups[0], scale)
    out = torch.empty_like(q)
    for group in groups:
        group_out = _attend_group(q, k_cache, v_cache, group, scale)
        if group.output_rows is not None:
            group_out = group_out.index_select(0, group.output_rows)
        out.index_copy_(0, group.output_tokens, group_out)
    return out


def _attend_group(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
) -> torch.Tensor:
    """One padded group -> [B * Q, num_heads, head_dim] (pad rows included)."""
    batch, max_query_len = group.query_index.shape
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    max_ctx = group.num_blocks * block_size
    queries = q.index_select(0, group.query_index.reshape(-1))
    keys = _gather_context(k_cache, group.block_ids, batch, max_ctx, "keys")
    values = _gather_context(v_cache, group.block_ids, batch, max_ctx, "values")
    if group.is_decode:  # [B, Hkv, G, D]: the G heads of a kv head are its query rows
        queries = queries.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        mask = group.additive_mask(q.dtype)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(batch, num_heads, head_dim)
    queries = queries.view(batch, max_query_len, num_heads, head_dim).transpose(1, 2)
    if group.causal_len is not None:
        keys, values = keys[:, :, : group.causal_len], values[:, :, : group.causal_len]
        out = F.scaled_dot_product_attention(
            queries, keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        mask = group.additive_mask(q.dtype)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
    return out.transpose(1, 2).reshape(batch * max_query_len, num_heads, head_dim)


def _gather_context(
    cache: torch.Tensor, block_ids: torch.Tensor, batch: int, max_ctx: int, buffer: str
) -> torch.Tensor:
    """[B, num_kv_heads, max_ctx, head_dim] (a transposed view): each request's blocks, in
    order, gathered block by block into a reused workspace buffer. SDPA reads the strided view
    directly (on CPU ~3x faster than a contiguous copy, and no fresh pages to fault in)."""
    num_kv_heads, head_dim = cache.shape[-2:]
    out = _WORKSPACE.get(buffer, (len(block_ids), *cache.shape[1:]), cache.dtype, cache.device)
    torch.index_select(cache, 0, block_ids, out=out)
    return out.view(batch, max_ctx, num_kv_heads, head_dim).transpose(1, 2)


class Workspace:
    """Grow-only scratch buffers, shared by all layers (they run one after another)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        numel = math.prod(shape)
        key = (name, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:numel].view(shape)

    def clear(self) -> None:
        self._buffers.clear()


_WORKSPACE = Workspace()


# ---------------------------------------------------------------------------------------------
# The CPU backend ("torch"): the same math on a head-major KV cache, tuned for decode batches.
#
# Layout, per layer: k_cache, v_cache of shape [num_kv_heads, num_blocks, block_size, head_dim],
# so a request's context for one kv head is a list of contiguous [block_size, head_dim] tiles.
#
# Decode (q_len == 1), the hot path, runs one of two ways:
#  * the C++ kernel below (float32, AVX-512; built just-in-time on first use, like the CUDA
#    backend's): one call per layer covers every decode request, reading each K/V tile in
#    place, once, for the G query heads of its kv head; no gather, no padding;
#  * otherwise pure torch: requests sorted by context length and cut into a few buckets, each
#    padded only to its own longest context; per bucket, K and V are gathered head-major from
#    the flat [num_kv_heads * num_blocks, block_size, head_dim] view straight into the layout of
#    a batched matmul ([Hkv * B, C, D], reused workspace buffers), and attention is two bmm
#    calls with the G query heads of a kv head as the rows (GQA without repeating K/V).
# Prefill chunks (q_len > 1) go one request at a time through SDPA over their own gathered
# blocks: is_causal when the chunk starts the prompt, else a causal mask offset by the context.
# ---------------------------------------------------------------------------------------------

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
    key = (num_kv_heads, num_blocks, dtype, with_buckets)
    plan = metadata._plans.get(key)
    if plan is None:
        plan = build_head_major_plan(metadata, num_kv_heads, num_blocks, dtype, with_buckets)
        metadata._plans[key] = plan
    return plan


def write_kv_cache_head_major(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim] (any strides); caches [num_kv_heads,
    num_blocks, block_size, head_dim]: cache[h].flat[slot_mapping[i]] = k[i, h] (and v)."""
    if (
        _cpu_kernel_state is True
        and k.device.type == "cpu"
        and k.dtype == k_cache.dtype == torch.float32
        and k.stride(-1) == 1
        and v.stride(-1) == 1
        and slot_mapping.dtype == torch.int64
    ):
        torch.ops.pagedserve_cpu.write_kv_head_major(k, v, k_cache, v_cache, slot_mapping)
        return
    num_kv_heads, _, _, head_dim = k_cache.shape
    k_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, v.transpose(0, 1))


def paged_attention_head_major(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] (any strides) -> [num_tokens, num_heads, head_dim];
    head-major caches. use_kernel: None picks the C++ decode kernel whenever it applies."""
    num_kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    if use_kernel is None:
        use_kernel = cpu_decode_kernel_applies(q, num_kv_heads)
    plan = head_major_plan(metadata, num_kv_heads, num_blocks, q.dtype, not use_kernel)
    if out is None:
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
    return out


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
    shape = (rows * bucket.num_blocks, block_size, head_dim)
    keys = _WORKSPACE.get("keys", shape, dtype, device)
    torch.index_select(k_rows, 0, bucket.block_ids, out=keys)
    scores = _WORKSPACE.get("scores", (rows, group, ctx), dtype, device)
    torch.bmm(q_t.view(rows, group, head_dim), keys.view(rows, ctx, head_dim).mT, out=scores)
    if bucket.mask is not None:
        scores.view(num_kv_heads, batch, group, ctx).add_(bucket.mask)
    probs = torch.softmax(scores, dim=-1)
    values = _WORKSPACE.get("values", shape, dtype, device)
    torch.index_select(v_rows, 0, bucket.block_ids, out=values)
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
    keys = k_rows.index_select(0, chunk.block_ids).view(shape)[:, : chunk.seq_len]
    values = v_rows.index_select(0, chunk.block_ids).view(shape)[:, : chunk.seq_len]
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


# ---------------------------------------------------------------------------------------------
# The C++ CPU kernels (float32, AVX-512), built with torch.utils.cpp_extension on first use and
# cached under TORCH_EXTENSIONS_DIR (~/.cache/torch_extensions): ~25 s the first time on a
# machine, ~1 s to load after. Off when PAGEDSERVE_CPU_KERNELS=0, when the CPU lacks AVX-512 or
# when the build fails (no compiler, no ninja): the pure-torch paths then run, same math.
#
# paged_decode: per (kv head h, request b), its G = num_heads / num_kv_heads query heads at
# once, block by block through the block table, reading each K/V row once and in place:
# pass 1 s_j = scale * <q_g, K_j> (16 keys at a time, their 16 horizontal sums in one
# transpose-and-add tree), pass 2 p_j = exp(s_j - max) (Cephes' exp polynomial, ~1 ulp) and
# their sum, pass 3 out_g = sum_j p_j V_j / sum. head_dim 16, 32, 64 or 128; G 1, 2, 4 or 8.
# Tasks are split over torch's intra-op threads by kv head, so each thread sees every request
# (balanced whatever the context lengths).
# The per-token kernels (used by models.layers on the CPU path) fold several ATen ops into one
# pass each: rms_norm, fused_add_rms_norm (in place), rotary_inplace (the reference's products
# and sums, bit-identical: built with -ffp-contract=off), silu_and_mul, write_kv_head_major.
# ---------------------------------------------------------------------------------------------

_CPU_KERNEL_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <immintrin.h>

namespace {

// exp(x) for x <= 0 (Cephes expf: range reduction by ln 2, degree-6 polynomial).
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 fx = _mm512_roundscale_ps(
      _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, fx);
}

constexpr int MAX_GROUP = 8;

// r[l] = sum of the 16 lanes of a[l], for 16 vectors at once (a transpose-and-add tree:
// 45 shuffles and adds instead of 16 horizontal reductions).
inline __m512 reduce16(__m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88),
                       _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

// One (request, kv head): G query heads against the request's L keys. D = 16 * C.
template <int C, int G>
void decode_one(const float* const* q_rows, float* const* out_rows, const float* k_base,
                const float* v_base, const int32_t* table, int64_t L, int64_t block_size,
                float scale, float* scores) {
  constexpr int D = 16 * C;
  __m512 qv[G][C];
  float row_max[G], row_sum[G];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c)
      qv[g][c] = _mm512_mul_ps(_mm512_loadu_ps(q_rows[g] + 16 * c), _mm512_set1_ps(scale));
    row_max[g] = -std::numeric_limits<float>::infinity();
  }
  __m512 tile_max[G];
  for (int g = 0; g < G; ++g) tile_max[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j0 = 0, i = 0; j0 < L; j0 += block_size, ++i) {  // pass 1: scores
    const float* kb = k_base + static_cast<int64_t>(table[i]) * block_size * D;
    const int64_t n = std::min<int64_t>(block_size, L - j0);
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {  // 16 keys at a time
      __m512 partial[G][16];
      for (int u = 0; u < 16; ++u) {
        __m512 kv[C];
        for (int c = 0; c < C; ++c) kv[c] = _mm512_loadu_ps(kb + (t + u) * D + 16 * c);
        for (int g = 0; g < G; ++g) {
          __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
          for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
          partial[g][u] = acc;
        }
      }
      for (int g = 0; g < G; ++g) {
        const __m512 sv = reduce16(partial[g]);
        _mm512_storeu_ps(scores + g * L + j0 + t, sv);
        tile_max[g] = _mm512_max_ps(tile_max[g], sv);
      }
    }
    for (; t < n; ++t) {
      __m512 kv[C];
      for (int c = 0; c < C; ++c) kv[c] = _mm512_loadu_ps(kb + t * D + 16 * c);
      for (int g = 0; g < G; ++g) {
        __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
        const float s = _mm512_reduce_add_ps(acc);
        scores[g * L + j0 + t] = s;
        row_max[g] = std::max(row_max[g], s);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    row_max[g] = std::max(row_max[g], _mm512_reduce_max_ps(tile_max[g]));
  for (int g = 0; g < G; ++g) {  // pass 2: p = exp(s - max), sums
    float* s = scores + g * L;
    const __m512 m = _mm512_set1_ps(row_max[g]);
    __m512 sum = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= L; j += 16) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
      _mm512_storeu_ps(s + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (j < L) {
      const __mmask16 mask = static_cast<__mmask16>((1u << (L - j)) - 1u);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + j), m));
      _mm512_mask_storeu_ps(s + j, mask, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, e));
    }
    row_sum[g] = _mm512_reduce_add_ps(sum);
  }
  __m512 acc[G][C];  // pass 3: sum_j p_j V_j
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t j0 = 0, i = 0; j0 < L; j0 += block_size, ++i) {
    const float* vb = v_base + static_cast<int64_t>(table[i]) * block_size * D;
    const int64_t n = std::min<int64_t>(block_size, L - j0);
    for (int64_t t = 0; t < n; ++t) {
      __m512 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(vb + t * D + 16 * c);
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * L + j0 + t]);
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(1.0f / row_sum[g]);
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(out_rows[g] + 16 * c, _mm512_mul_ps(acc[g][c], inv));
  }
}

// out[rows[b], h] = softmax(scale * q[rows[b], h] K_b^T) V_b for each decode request b.
// q, out [T, H, D] float32 with a unit last stride; caches [Hkv, num_blocks, block_size, D]
// contiguous; block_tables [B, W] int32 contiguous; seq_lens, rows [B] int64.
void paged_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, const at::Tensor& rows, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
              k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat);
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4);
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "unit last stride expected");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kLong &&
              rows.scalar_type() == at::kLong);
  const int64_t B = rows.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(0), N = k_cache.size(1), block_size = k_cache.size(2);
  TORCH_CHECK(H % Hkv == 0 && H / Hkv <= MAX_GROUP && k_cache.size(3) == D);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && out.size(1) == H && out.size(2) == D);
  TORCH_CHECK(D == 16 || D == 32 || D == 64 || D == 128, "head_dim must be 16, 32, 64 or 128");
  TORCH_CHECK(seq_lens.size(0) == B && block_tables.size(0) == B);
  const int G = static_cast<int>(H / Hkv);
  const int64_t W = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  int64_t max_len = 1;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= W * block_size, "seq_len outside the block table");
    TORCH_CHECK(rp[b] >= 0 && rp[b] < q.size(0) && rp[b] < out.size(0), "row out of range");
    for (int64_t i = 0; i * block_size < lp[b]; ++i)
      TORCH_CHECK(tp[b * W + i] >= 0 && tp[b * W + i] < N, "block id out of range");
    max_len = std::max(max_len, lp[b]);
  }
  const float fscale = static_cast<float>(scale);
  using Kernel = void (*)(const float* const*, float* const*, const float*, const float*,
                         const int32_t*, int64_t, int64_t, float, float*);
  static const Kernel kernels[4][4] = {
      {&decode_one<1, 1>, &decode_one<1, 2>, &decode_one<1, 4>, &decode_one<1, 8>},
      {&decode_one<2, 1>, &decode_one<2, 2>, &decode_one<2, 4>, &decode_one<2, 8>},
      {&decode_one<4, 1>, &decode_one<4, 2>, &decode_one<4, 4>, &decode_one<4, 8>},
      {&decode_one<8, 1>, &decode_one<8, 2>, &decode_one<8, 4>, &decode_one<8, 8>}};
  TORCH_CHECK(G == 1 || G == 2 || G == 4 || G == 8, "num_heads / num_kv_heads: 1, 2, 4 or 8");
  const int gi = G == 1 ? 0 : G == 2 ? 1 : G == 4 ? 2 : 3;
  const Kernel kernel = kernels[D == 16 ? 0 : D == 32 ? 1 : D == 64 ? 2 : 3][gi];
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(G) * max_len);
    const float* q_rows[MAX_GROUP];
    float* out_rows[MAX_GROUP];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / B, b = task % B;
      for (int g = 0; g < G; ++g) {
        q_rows[g] = qp + rp[b] * qs0 + (h * G + g) * qs1;
        out_rows[g] = op + rp[b] * os0 + (h * G + g) * os1;
      }
      const float* kb = kp + h * N * block_size * D;
      const float* vb = vp + h * N * block_size * D;
      const int32_t* table = tp + b * W;
      kernel(q_rows, out_rows, kb, vb, table, lp[b], block_size, fscale, scores.data());
    }
  });
}

// ---- per-token kernels (float32, rows contiguous in the last dim) -----------------------------

inline __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }

// y = weight * (x * rsqrt(mean(x^2) + eps)) for one row of n floats (sum of squares in float32,
// 16 lanes then a tree; x * r and the weight product rounded separately, as in transformers).
inline void rms_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  if (i < n) {
    const __m512 v = _mm512_maskz_loadu_ps(tail_mask(n - i), x + i);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  const float mean = _mm512_reduce_add_ps(acc) / static_cast<float>(n);
  const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(mean + eps));
  for (i = 0; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_loadu_ps(w + i),
                                          _mm512_mul_ps(_mm512_loadu_ps(x + i), r)));
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 xr = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), r);
    _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + i), xr));
  }
}

void check_rows(const at::Tensor& t, int64_t n) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1 && t.size(1) == n);
}

// out = rms_norm(x); x, out [T, n]
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t T = x.size(0), n = x.size(1);
  check_rows(x, n), check_rows(out, n);
  TORCH_CHECK(out.size(0) == T);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n && weight.scalar_type() == at::kFloat);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) rms_row(xp + t * xs, wp, op + t * os, n, float(eps));
  });
}

// residual += x; x = rms_norm(residual) (both in place); x, residual [T, n]
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  const int64_t T = x.size(0), n = x.size(1);
  check_rows(x, n), check_rows(residual, n);
  TORCH_CHECK(residual.size(0) == T);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n && weight.scalar_type() == at::kFloat);
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* xr = xp + t * xs;
      float* rr = rp + t * rs;
      int64_t i = 0;
      for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(rr + i, _mm512_add_ps(_mm512_loadu_ps(xr + i), _mm512_loadu_ps(rr + i)));
      for (; i < n; ++i) rr[i] = xr[i] + rr[i];
      rms_row(rr, wp, xr, n, static_cast<float>(eps));
    }
  });
}

// In place on qk [T, heads, D] (unit last stride): x = [x1, x2] -> [x1 c - x2 s, x2 c + x1 s],
// c = cos_cache[positions[t]], s = sin_cache[positions[t]] ([P, D / 2] each).
void rotary_inplace(at::Tensor qk, const at::Tensor& positions, const at::Tensor& cos_cache,
                    const at::Tensor& sin_cache) {
  TORCH_CHECK(qk.scalar_type() == at::kFloat && qk.dim() == 3 && qk.stride(2) == 1);
  TORCH_CHECK(cos_cache.is_contiguous() && sin_cache.is_contiguous() &&
              cos_cache.scalar_type() == at::kFloat && sin_cache.scalar_type() == at::kFloat);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous());
  const int64_t T = qk.size(0), heads = qk.size(1), half = qk.size(2) / 2;
  TORCH_CHECK(cos_cache.size(1) == half && qk.size(2) == 2 * half);
  float* p = qk.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cc = cos_cache.data_ptr<float>();
  const float* sc = sin_cache.data_ptr<float>();
  const int64_t s0 = qk.stride(0), s1 = qk.stride(1), P = cos_cache.size(0);
  at::parallel_for(0, T, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position outside the rotary cache");
      const float* c = cc + pos[t] * half;
      const float* s = sc + pos[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* x = p + t * s0 + h * s1;
        int64_t i = 0;
        for (; i + 16 <= half; i += 16) {
          const __m512 x1 = _mm512_loadu_ps(x + i), x2 = _mm512_loadu_ps(x + half + i);
          const __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
          const __m512 y1 = _mm512_sub_ps(_mm512_mul_ps(x1, cv), _mm512_mul_ps(x2, sv));
          const __m512 y2 = _mm512_add_ps(_mm512_mul_ps(x2, cv), _mm512_mul_ps(x1, sv));
          _mm512_storeu_ps(x + i, y1);
          _mm512_storeu_ps(x + half + i, y2);
        }
        for (; i < half; ++i) {
          const float x1 = x[i], x2 = x[half + i];
          x[i] = x1 * c[i] - x2 * s[i];
          x[half + i] = x2 * c[i] + x1 * s[i];
        }
      }
    }
  });
}

// out = silu(x[:, :n]) * x[:, n:], x [T, 2n], out [T, n]; silu(g) = g / (1 + exp(-g))
void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  const int64_t T = x.size(0), n = out.size(1);
  check_rows(x, 2 * n), check_rows(out, n);
  TORCH_CHECK(out.size(0) == T);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  const __m512 one = _mm512_set1_ps(1.0f);
  at::parallel_for(0, T, 32, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* g = xp + t * xs;
      const float* u = g + n;
      float* o = op + t * os;
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = i + 16 <= n ? static_cast<__mmask16>(0xFFFF) : tail_mask(n - i);
        const __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 sig = _mm512_div_ps(gv, _mm512_add_ps(one, e));
        _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(sig, _mm512_maskz_loadu_ps(m, u + i)));
      }
    }
  });
}

// Head-major caches [Hkv, num_blocks, block_size, D]: cache[h].flat[slots[t]] = k[t, h] (and v);
// k, v [T, Hkv, D] with a unit last stride; negative slots are skipped.
void write_kv_head_major(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                         at::Tensor v_cache, const at::Tensor& slots) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
              k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat);
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous());
  const int64_t T = k.size(0), Hkv = k.size(1), D = k.size(2);
  TORCH_CHECK(k_cache.size(0) == Hkv && k_cache.size(3) == D && slots.numel() == T);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v.size(0) == T && v.size(1) == Hkv &&
              v.size(2) == D);
  const int64_t per_head = k_cache.size(1) * k_cache.size(2);
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  at::parallel_for(0, T, 256, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t slot = sp[t];
      if (slot < 0) continue;
      TORCH_CHECK(slot < per_head, "slot outside the cache");
      for (int64_t h = 0; h < Hkv; ++h) {
        std::memcpy(kc + (h * per_head + slot) * D, kp + t * ks0 + h * ks1, D * sizeof(float));
        std::memcpy(vc + (h * per_head + slot) * D, vp + t * vs0 + h * vs1, D * sizeof(float));
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor rows, float scale) -> ()");
  m.impl("paged_decode", c10::DispatchKey::CPU, &paged_decode);
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.impl("fused_add_rms_norm", c10::DispatchKey::CPU, &fused_add_rms_norm);
  m.def("rotary_inplace(Tensor(a!) qk, Tensor positions, Tensor cos_cache, Tensor sin_cache) "
        "-> ()");
  m.impl("rotary_inplace", c10::DispatchKey::CPU, &rotary_inplace);
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.def("write_kv_head_major(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slots) -> ()");
  m.impl("write_kv_head_major", c10::DispatchKey::CPU, &write_kv_head_major);
}
"""

_cpu_kernel_state: bool | None = None  # None: not tried yet


def load_cpu_kernels() -> bool:
    """Build (first time on a machine) and load the C++ CPU kernels; False when they cannot be
    used here (then the torch paths run). Safe to call repeatedly and from several processes
    (torch's build lock serialises concurrent builds)."""
    global _cpu_kernel_state
    if _cpu_kernel_state is not None:
        return _cpu_kernel_state
    _cpu_kernel_state = False
    if os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") == "0":
        return False
    try:
        if torch.backends.cpu.get_cpu_capability() != "AVX512":
            return False
        if not hasattr(torch.ops.pagedserve_cpu, "paged_decode"):
            from torch.utils.cpp_extension import load_inline

            logger.info("loading the C++ CPU kernels (built on first use, ~30 s)")
            flags = ["-O3", "-ffp-contract=off", "-mavx512f", "-mavx512dq", "-mavx512bw"]
            flags += ["-mavx512vl", "-mfma"]
            load_inline(
                name="pagedserve_cpu_kernels",
                cpp_sources=[_CPU_KERNEL_SOURCE],
                extra_cflags=[*flags, "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
            )
        _cpu_kernel_state = hasattr(torch.ops.pagedserve_cpu, "paged_decode")
    except Exception as exc:  # no compiler, build error, ...: the torch path runs
        logger.warning("C++ CPU kernels unavailable (%s); using the torch paths", exc)
    return _cpu_kernel_state


def cpu_kernels_loaded() -> bool:
    """Whether the C++ CPU kernels are loaded (load_cpu_kernels() succeeded); never builds."""
    return _cpu_kernel_state is True


def cpu_decode_kernel_applies(q: torch.Tensor, num_kv_heads: int) -> bool:
    """Whether the C++ kernel (already loaded; this never builds it) takes q's decode rows."""
    return (
        _cpu_kernel_state is True
        and q.device.type == "cpu"
        and q.dtype == torch.float32
        and q.shape[-1] in (16, 32, 64, 128)
        and q.stride(-1) == 1
        and q.shape[1] % num_kv_heads == 0
        and q.shape[1] // num_kv_heads in (1, 2, 4, 8)
    )


AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor
]
KvWriteFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
# name -> paged_attention(q, k_cache, v_cache, metadata, scale) / write_kv_cache(...)
ATTENTION_BACKENDS: dict[str, AttentionFn] = {
    "torch": paged_attention_head_major,
    "torch_ref": paged_attention,
}
KV_CACHE_WRITERS: dict[str, KvWriteFn] = {
    "torch": write_kv_cache_head_major,
    "torch_ref": write_kv_cache,
}
# Per-layer cache layout of each backend: "token_major" = [num_blocks, block_size, kv_heads,
# head_dim] (the reference and the Triton kernels), "head_major" = [kv_heads, num_blocks,
# block_size, head_dim] (the CPU backend). Backends not listed are token_major.
KV_CACHE_LAYOUTS: dict[str, str] = {"torch": "head_major", "torch_ref": "token_major"}


def kv_cache_layer_shape(
    backend: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    """The shape of one layer's k (or v) cache for `backend`."""
    if KV_CACHE_LAYOUTS.get(backend, "token_major") == "head_major":
        return (num_kv_heads, num_blocks, block_size, head_dim)
    return (num_blocks, block_size, num_kv_heads, head_dim)


# backends living in their own module, which exposes paged_attention_backend + write_kv_cache
_BACKEND_MODULES = {
    "triton": "pagedserve.kernels.triton_attention",
    "cuda": "pagedserve.kernels.cuda_attention",  # builds csrc/ with nvcc on import
}


def resolve_attention_backend(name: str) -> str:
    """Register `name` (importing its module on first use); fall back to 'torch' if absent."""
    if name not in ATTENTION_BACKENDS and name in _BACKEND_MODULES:
        try:
            module = importlib.import_module(_BACKEND_MODULES[name])
            ATTENTION_BACKENDS[name] = module.paged_attention_backend
            KV_CACHE_WRITERS[name] = module.write_kv_cache
        except (ImportError, AttributeError) as exc:
            logger.warning("attention backend %r failed to load: %s", name, exc)
    if name not in ATTENTION_BACKENDS:
        logger.warning("attention backend %r unavailable; using torch", name)
        return "torch"
    return name
