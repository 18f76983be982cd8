"""The pure-torch reference of paged attention ("torch_ref"): token-major cache; the Triton and
CUDA kernels are checked against it.

Token-major KV cache, per layer: `k_cache`, `v_cache` of shape
[num_blocks, block_size, num_kv_heads, head_dim] (slots as in attention_metadata).

Math. A step holds a batch of requests, each with q_len >= 1 new tokens (a prefill chunk or one
decode token) laid out back to back in `q` ([num_tokens, num_heads, head_dim]). Request b has
seq_len_b tokens in context once this step's keys are written (new ones included), so its first
new token sits at position ctx_b = seq_len_b - q_len_b. With G = num_heads / num_kv_heads (GQA),
query i of request b, head h, reads kv head h // G over keys j = 0 .. ctx_b + i (causal):

    s_j = scale * <q[b, i, h], K[b, j, h // G]>
    out[b, i, h] = sum_j softmax_j(s) * V[b, j, h // G]

Three per-layer options: a sliding `window` W > 0 (Gemma, Mistral v0.1) keeps only the keys
j > ctx_b + i - W (the W latest positions, the query's own included); a logit `softcap` c > 0
(Gemma 2) replaces s_j by c tanh(s_j / c) before the softmax; attention `sinks` (GPT-OSS), a
learned logit sink[h] per query head, join the softmax's denominator only:

    out[b, i, h] = sum_j e^(s_j - m) V[b, j, h // G] / (e^(sink[h] - m) + sum_j e^(s_j - m))

with m = max(max_j s_j, sink[h]) over the keys the query attends (a query that attends none
gets 0). Any of them takes the explicit path below (scores, mask, softmax in float32) instead
of SDPA.

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
An fp8 cache (kernels.kv_quant) is read as q's dtype, k_scale folded into the softmax scale and
v_scale into the output.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedserve.kernels.attention_metadata import AttentionMetadata, cdiv
from pagedserve.kernels.kv_quant import is_fp8, raw, to_cache_values
from pagedserve.kernels.workspace import Workspace

PADDING_WASTE_LIMIT = 1.5  # a prefill bucket's padded area <= this x its real q_len * seq_len


@dataclass
class AttentionGroup:
    """Requests attended together: [batch, max_query_len] queries x [batch, max_ctx] keys."""

    query_index: torch.Tensor  # [B, Q] int64: token row of each query (pads repeat the last)
    block_ids: torch.Tensor  # [B * num_blocks] int64: each request's blocks, padded
    num_blocks: int
    key_mask: torch.Tensor  # [B, Q, C] bool: query (b, i) may attend key j
    key_limit: torch.Tensor  # [B, Q] int64: the last key position query (b, i) attends
    output_rows: torch.Tensor | None  # [n] flat positions in B*Q that are real (None: all)
    output_tokens: torch.Tensor  # [n] token rows receiving them
    is_whole_batch: bool  # output_tokens == arange(num_tokens): no scatter needed
    causal_len: int | None = None  # one prompt with no earlier context: is_causal over this
    _masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def is_decode(self) -> bool:
        return self.query_index.shape[1] == 1

    def window_mask(self, window: int) -> torch.Tensor:
        """[B, Q, C] bool: key_mask within a sliding window of `window` keys (0: none), built
        once a step."""
        if window not in self._window_masks:
            mask = self.key_mask
            if window:
                keys = torch.arange(mask.shape[-1], device=mask.device)
                mask = mask & (keys[None, None, :] > (self.key_limit - window)[..., None])
            self._window_masks[window] = mask
        return self._window_masks[window]

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, Q, C] float mask: 0 where key_mask is set, -inf elsewhere."""
        if dtype not in self._masks:
            mask = torch.zeros(self.key_mask.shape, dtype=dtype, device=self.key_mask.device)
            self._masks[dtype] = mask.masked_fill_(~self.key_mask, float("-inf")).unsqueeze(1)
        return self._masks[dtype]


def torch_groups(metadata: AttentionMetadata) -> list[AttentionGroup]:
    """The step's padded groups (decodes, then prefill buckets), built on first use and kept
    for the step's other layers."""
    return metadata.plan("torch_ref", lambda: _build_groups(metadata))


def _build_groups(metadata: AttentionMetadata) -> list[AttentionGroup]:
    decode = metadata.query_lens_cpu == 1
    decode_rows = decode.nonzero().squeeze(1)
    prefill_rows = (~decode).nonzero().squeeze(1)
    buckets = [decode_rows] if len(decode_rows) else []
    if len(prefill_rows):
        buckets += _bucket_prefills(metadata, prefill_rows)
    return [_build_group(metadata, rows) for rows in buckets]


def _bucket_prefills(metadata: AttentionMetadata, rows: torch.Tensor) -> list[torch.Tensor]:
    """Rows by context length, longest first, cut where a bucket's padded area
    B * max_q * max_ctx would exceed PADDING_WASTE_LIMIT x its real area."""
    order = rows[torch.argsort(metadata.seq_lens_cpu[rows], descending=True, stable=True)]
    query_lens = metadata.query_lens_cpu[order].tolist()
    seq_lens = metadata.seq_lens_cpu[order].tolist()
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


def _build_group(metadata: AttentionMetadata, rows: torch.Tensor) -> AttentionGroup:
    query_lens, seq_lens = metadata.query_lens_cpu[rows], metadata.seq_lens_cpu[rows]
    starts = torch.cumsum(metadata.query_lens_cpu, 0)[rows] - query_lens
    max_query_len = int(query_lens.max())
    num_blocks = cdiv(int(seq_lens.max()), metadata.block_size)
    offsets = torch.arange(max_query_len)
    query_pos = torch.minimum(offsets[None, :], (query_lens - 1)[:, None])  # [B, Q]
    query_index = starts[:, None] + query_pos
    key_limit = (seq_lens - query_lens)[:, None] + query_pos
    keys = torch.arange(num_blocks * metadata.block_size)
    key_mask = keys[None, None, :] <= key_limit[..., None]
    block_ids = metadata.block_tables_cpu[rows, :num_blocks].reshape(-1).long()
    output_rows = None
    output_tokens = query_index.reshape(-1)
    if max_query_len > 1:
        output_rows = (offsets[None, :] < query_lens[:, None]).reshape(-1).nonzero().squeeze(1)
        output_tokens = output_tokens[output_rows]
    num_tokens = metadata.num_tokens
    no_padding = len(rows) * max_query_len == num_tokens == len(output_tokens)
    whole = no_padding and bool((output_tokens == torch.arange(num_tokens)).all())
    causal_len = None
    if len(rows) == 1 and int(query_lens[0]) == int(seq_lens[0]) > 1:
        causal_len = int(seq_lens[0])
    device = metadata.slot_mapping.device
    return AttentionGroup(
        query_index=query_index.to(device),
        block_ids=block_ids.to(device),
        num_blocks=num_blocks,
        key_mask=key_mask.to(device),
        key_limit=key_limit.to(device),
        output_rows=None if output_rows is None else output_rows.to(device),
        output_tokens=output_tokens.to(device),
        is_whole_batch=whole,
        causal_len=causal_len,
    )


def real_rows(
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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]; cache[slot_mapping[i]] = k[i] (and v; fp8
    caches: divided by the scale and rounded); rows with a negative slot (padding) are
    skipped."""
    k, v, slot_mapping = real_rows(k, v, slot_mapping)
    k, v = to_cache_values(k, k_cache, k_scale), to_cache_values(v, v_cache, v_scale)
    num_kv_heads, head_dim = k_cache.shape[-2:]
    raw(k_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, raw(k))
    raw(v_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, raw(v))


def paged_attention(
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
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] -> the same shape (see the module doc); window,
    softcap: the layer's sliding window and logit softcap (0: none); sinks: its float32 sink
    logits, [num_heads] (None: none)."""
    groups = torch_groups(metadata)
    scale *= k_scale
    if window or softcap or sinks is not None:
        attend = functools.partial(
            _attend_group_explicit, window=window, softcap=softcap, sinks=sinks
        )
    else:
        attend = _attend_group
    if len(groups) == 1 and groups[0].is_whole_batch:
        out = attend(q, k_cache, v_cache, groups[0], scale)
    else:
        out = torch.empty_like(q)
        for group in groups:
            group_out = attend(q, k_cache, v_cache, group, scale)
            if group.output_rows is not None:
                group_out = group_out.index_select(0, group.output_rows)
            out.index_copy_(0, group.output_tokens, group_out)
    return out if v_scale == 1.0 else out.mul_(v_scale)


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
    keys = _gather_context(k_cache, group.block_ids, batch, max_ctx, "keys", q.dtype)
    values = _gather_context(v_cache, group.block_ids, batch, max_ctx, "values", q.dtype)
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


def _attend_group_explicit(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """_attend_group with a sliding window, a logit softcap and / or attention sinks: scores,
    mask and softmax written out, in float32."""
    batch, max_query_len = group.query_index.shape
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    max_ctx = group.num_blocks * block_size
    group_size = num_heads // num_kv_heads
    queries = q.index_select(0, group.query_index.reshape(-1)).float()
    queries = queries.view(batch, max_query_len, num_heads, head_dim).transpose(1, 2)
    keys = _gather_context(k_cache, group.block_ids, batch, max_ctx, "keys", q.dtype)
    values = _gather_context(v_cache, group.block_ids, batch, max_ctx, "values", q.dtype)
    keys = keys.float().repeat_interleave(group_size, dim=1)  # [B, H, C, D]
    values = values.float().repeat_interleave(group_size, dim=1)
    scores = queries @ keys.transpose(-1, -2) * scale  # [B, H, Q, C]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~group.window_mask(window)[:, None], float("-inf"))
    sink_logits = None if sinks is None else sinks.view(1, num_heads, 1, 1)
    out = softmax_with_sinks(scores, sink_logits) @ values  # [B, H, Q, D]
    return out.to(q.dtype).transpose(1, 2).reshape(batch * max_query_len, num_heads, head_dim)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The softmax of float32 `scores` over the last dim, masked keys at -inf; with `sinks`
    (float32 logits broadcasting to scores[..., :1]) joined to its denominator only:
    e^(s_j - m) / (e^(sink - m) + sum_j e^(s_j - m)), m = max(max_j s_j, sink), so that a row
    with no key gives 0."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks)
    probs = (scores - top).exp_()
    return probs.div_(probs.sum(dim=-1, keepdim=True).add_((sinks - top).exp_()))


def _gather_context(
    cache: torch.Tensor,
    block_ids: torch.Tensor,
    batch: int,
    max_ctx: int,
    buffer: str,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[B, num_kv_heads, max_ctx, head_dim] (a transposed view) of `dtype`: each request's
    blocks, in order, gathered block by block into a reused workspace buffer (an fp8 cache's
    then converted). SDPA reads the strided view directly (on CPU ~3x faster than a contiguous
    copy, and no fresh pages to fault in)."""
    num_kv_heads, head_dim = cache.shape[-2:]
    out = _WORKSPACE.get(buffer, (len(block_ids), *cache.shape[1:]), cache.dtype, cache.device)
    torch.index_select(cache, 0, block_ids, out=out)
    if is_fp8(cache):
        out = out.to(dtype)
    return out.view(batch, max_ctx, num_kv_heads, head_dim).transpose(1, 2)


_WORKSPACE = Workspace()
