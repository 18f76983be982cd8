"""Paged attention: the per-step metadata, the pure-torch reference and the CPU backend.

Backends (ATTENTION_BACKENDS / KV_CACHE_WRITERS, by name):
  * "torch_ref": the reference below (`paged_attention`, `write_kv_cache`), token-major cache;
    the Triton / CUDA kernels are checked against it.
  * "torch": the CPU backend (further down): a head-major cache, a C++ decode kernel (built on
    first use; pure torch when it cannot be) and per-request SDPA for prefill chunks.
  * "triton", "cuda": in their own modules, token-major. On a GPU the engine's default
    ("auto") is "cuda": the CUDA C++ decode kernel of csrc/ (measured faster than Triton's on
    an H200, scripts/results/kernels_h200.md) with Triton for prefill chunks; "triton" where
    the CUDA kernel cannot be built.
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
from pathlib import Path

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
    cover the longest context), slot_mapping [num_tokens] int64. (The model runner does the
    two halves itself, metadata_inputs then assemble_attention_metadata, so that one transfer
    carries all of a step's inputs.)"""
    non_blocking = device.type == "cuda"
    inputs = metadata_inputs(query_lens, seq_lens, block_tables, slot_mapping)
    uploaded = [t.to(device, non_blocking=non_blocking) for t in inputs]
    return assemble_attention_metadata(
        uploaded, query_lens, seq_lens, block_tables, block_size, backend
    )


def metadata_inputs(
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> list[torch.Tensor]:
    """The device half of AttentionMetadata as CPU tensors in the kernels' dtypes:
    slot_mapping int64, query_start_loc [B + 1] int32, seq_lens int32, block_tables int32."""
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    torch.cumsum(query_lens, 0, out=query_start_loc[1:])
    return [
        slot_mapping.to(torch.int64),
        query_start_loc,
        seq_lens.to(torch.int32),
        block_tables.to(torch.int32),
    ]


def assemble_attention_metadata(
    device_inputs: list[torch.Tensor],
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    backend: str,
) -> AttentionMetadata:
    """AttentionMetadata from metadata_inputs' tensors on the device and the host tensors."""
    slot_mapping, query_start_loc, device_seq_lens, device_block_tables = device_inputs
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=device_seq_lens,
        block_tables=device_block_tables,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_size=block_size,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        block_tables_cpu=block_tables,
        backend=backend,
    )


def _unpadded(
    k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of a k/v write whose slot is real (padding rows carry slot -1)."""
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return k, v, slot_mapping
    return k[keep], v[keep], slot_mapping[keep]


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]; cache[slot_mapping[i]] = k[i] (and v);
    rows with a negative slot (padding) are skipped."""
    k, v, slot_mapping = _unpadded(k, v, slot_mapping)
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
    """Grow-only scratch buffers, shared by all layers (they run one after another); a buffer
    made under torch.inference_mode is replaced when asked for outside it."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        numel = math.prod(shape)
        key = (name, dtype, device)
        buffer = self._buffers.get(key)
        # a buffer made under inference mode cannot be written outside it (tests, eager use)
        stale = (
            buffer is not None and buffer.is_inference() and not torch.is_inference_mode_enabled()
        )
        if buffer is None or stale or buffer.numel() < numel:
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
    k, v, slot_mapping = _unpadded(k, v, slot_mapping)
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

CPU_KERNELS_CPP = Path(__file__).resolve().parents[2] / "csrc" / "cpu_kernels.cpp"

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
                cpp_sources=[CPU_KERNELS_CPP.read_text()],
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
    """Register `name` (importing its module on first use); fall back to 'triton' (for 'cuda'
    on a CUDA machine) or 'torch' if absent."""
    if name not in ATTENTION_BACKENDS and name in _BACKEND_MODULES:
        try:
            module = importlib.import_module(_BACKEND_MODULES[name])
            ATTENTION_BACKENDS[name] = module.paged_attention_backend
            KV_CACHE_WRITERS[name] = module.write_kv_cache
        except (ImportError, AttributeError) as exc:
            logger.warning("attention backend %r failed to load: %s", name, exc)
    if name not in ATTENTION_BACKENDS:
        if name == "cuda" and torch.cuda.is_available():  # no nvcc, say: Triton's kernels
            logger.warning("attention backend 'cuda' unavailable; using triton")
            return resolve_attention_backend("triton")
        logger.warning("attention backend %r unavailable; using torch", name)
        return "torch"
    return name
