"""Triton paged attention: the KV-cache write and varlen paged attention (prefill + decode).

Layout and math are those of `pagedserve.kernels.attention_ref` (the pure-torch reference):
caches [num_blocks, block_size, num_kv_heads, head_dim], token t of request b at slot
block_tables[b, t // block_size] * block_size + t % block_size; query i of request b (q_len_b
new tokens, seq_len_b tokens in context including them) attends keys 0 .. seq_len_b - q_len_b + i
of kv head h // G, G = num_heads / num_kv_heads.

Three per-layer options, the reference's: a sliding `window` W > 0 keeps only the keys
j > p - W of the query at position p = seq_len_b - q_len_b + i (its W latest positions, its
own included); a logit `softcap` c > 0 replaces each score s = scale * <q, k> by
c tanh(s / c) before the mask and the softmax; attention `sinks` (GPT-OSS: a learned logit
sink[h] per query head h, float32 [num_heads]) join the softmax's denominator only,
out = sum_j e^(s_j) v_j / (e^(sink[h]) + sum_j e^(s_j)). Each is a compile-time switch of
the kernels (WINDOWED, SOFTCAP, SINKS; off, the kernels are those without the options).

Kernels (all fp32 accumulation, an online softmax in base 2 with the scale folded in):

- `_write_kv_cache_kernel`: one program per token, copies its k and v rows into their slot.
- `_prefill_kernel` (requests with q_len > 1), FlashAttention-2 style: a program owns
  BLOCK_Q consecutive queries of one request times the G query heads of one kv head, i.e. a
  [BLOCK_M = BLOCK_Q * G, head_dim] query tile, so every K/V tile loaded from the cache serves
  all G heads (GQA). Its key loop is split in two: the tiles every row sees in full (no mask
  code at all), then the diagonal tiles (causal mask). The grid is (num_tokens // BLOCK_Q +
  batch, num_kv_heads): an upper bound on the query blocks that needs no host sync; programs
  run longest first (the step's `longest_first` order: requests by decreasing context, each
  request's last query block, the one with most keys, first); each program finds its request
  by a binary search and exits if it has no queries. Launch configuration: `PrefillTiles`.
- `_decode_kernel` + `_decode_reduce_kernel` (requests with q_len 1, i.e. every request when
  `max_query_len == 1`, and the decodes of a mixed batch): flash-decoding. The context of
  each (request, kv head) is cut into num_splits partitions handled by separate programs,
  each writing a partial output and its log-sum-exp; the reduce kernel merges them. With one
  split the decode kernel writes the output directly.

Scores, in base 2: s2 = (scale log2 e) <q, k>, or SOFTCAP s2 = (c log2 e) tanh((scale / c) <q, k>)
= c tanh(s / c) log2 e, with tanh(x) = 2 sigmoid(2x) - 1 (the interpreter runs no libdevice
tanh; the sigmoid runs and compiles everywhere). WINDOWED: the key loops start at the tile
holding the lowest key a program's queries see, so the tiles wholly before the window are
never read: decode from key seq_len - W, its splits cutting only the tiles from there (the
split count sized by the most tiles a window spans; an empty split has l = 0, lse = -inf and
weighs 0 in the reduce); prefill from key ctx + first - W + 1 (the tile's first query's),
masked up to the first tile every row's window covers (key kv_len - W on), then unmasked
tiles and the masked diagonal as without a window. Masked tiles mask each row's keys
below p - W + 1 and load no K/V row below the tile's lowest visible key; as a row may then
see no key in a tile, the running max is taken as 0 while it is -inf.

SINKS: the sink goes to base 2 as the scores do, s2 = sink[h] log2 e, and joins a query's
online softmax once, after its last key (`_join_sinks`): m' = max(m, s2),
acc' = acc 2^(m - m'), l' = l 2^(m - m') + 2^(s2 - m'), then out = acc' / l'. The prefill
kernel and the one-split decode kernel join it before their normalisation; with several
splits the reduce kernel does (the splits' partial outputs and log-sum-exps are those
without sinks).

Tiles of TILE_N keys may span several cache blocks (any block size works): the decode kernel
gathers each key's block id from the block table; the prefill kernel reads one entry per page
(block) when pages and tiles divide one another (the engine's power-of-two block sizes).
Triton's `tl.dot` needs every dimension >= 16, so the head group is padded to BLOCK_H >= 16
rows and head_dim to a power of two (masked).

Step metadata (shared by all layers of a step): block_tables [batch, max_blocks] int32,
seq_lens [batch] int32, query_start_loc [batch + 1] int32, the host ints max_query_len and
(optional, decode split sizing) max_seq_len, and (optional) the prefill launch order
longest_first [2 * batch + 1] int32 (attention_metadata.longest_first_order); write_kv_cache
also takes slot_mapping [num_tokens] (int32 or int64; slot < 0 = padding, skipped). Nothing
syncs with the host: the grids depend only on shapes and those host ints, so the launchers
can be captured in CUDA graphs (the decode split count derives from max_seq_len, else the
block-table width: keep it fixed per captured graph). Padding requests (q_len 0, seq_len 0)
are skipped / give zeros.

FP8 caches (float8_e4m3fn, kernels.kv_quant): the write stores clamp(x / scale, +-448) rounded
to fp8; attention loads the fp8 keys and values, converts them to q's dtype (exact) and folds
k_scale into qk_scale and v_scale into the output.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels.attention_metadata import AttentionMetadata
from pagedserve.kernels.triton_ops import _round_fp8

__all__ = [
    "PrefillTiles",
    "paged_attention",
    "paged_attention_backend",
    "prefill_tiles",
    "write_kv_cache",
]

LOG2E = 1.4426950408889634
_LOG2E: tl.constexpr = tl.constexpr(LOG2E)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CACHE_DTYPES = (*_FLOAT_DTYPES, torch.float8_e4m3fn)
_INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_HEAD_DIM = 256
_MAX_SPLITS = 64
# Launch tuning of the decode kernel (H200 measurements in scripts/gpu/bench_kernels.py):
# (TILE_N, num_warps, num_stages); the prefill kernel's is a PrefillTiles (prefill_tiles).
DECODE_TUNING: tuple[int, int, int] = (64, 4, 3)


@dataclass(frozen=True)
class PrefillTiles:
    """The prefill kernel's launch configuration: a program owns block_m query rows
    (block_m // group queries x the group's heads: GQA packed into M) and walks the keys
    block_n at a time; num_warps, num_stages (software pipelining of the K/V loads) as Triton's.
    block_m, block_n: powers of two >= 16 (tl.dot's least), block_m >= the group."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def prefill_tiles(
    device: torch.device, head_dim: int, group: int, max_query_len: int
) -> PrefillTiles:
    """The default tiles: the small tile (16 rows, or one query's heads) when the step's
    longest chunk fits it, else the large one: on CUDA 128 rows x 128 keys, 8 warps, 2 stages
    at head_dim <= 128 (H200, block size 16, scripts/gpu/sweep_prefill.py: 369 TFLOP/s on
    32 x 7.5k-token prompts, 245 registers, no spill; 128 x 64 keys: 331; 4 warps spill),
    64 rows x 32 keys past head_dim 128 (shared memory, registers; not measured); 64 rows on
    the CPU interpreter. Two sizes
    a shape, so that start-up compiles few variants; a mid-length chunk in the large tile
    computes masked rows (on attention that is small)."""
    small = max(16, triton.next_power_of_2(group))
    if max_query_len * group <= small:
        return PrefillTiles(small, 64, 4, 2)
    if device.type != "cuda":
        return PrefillTiles(max(small, 64), 64, 4, 2)
    if head_dim <= 128:
        return PrefillTiles(max(small, 128), 128, 8, 2)
    return PrefillTiles(max(small, 64), 32, 4, 2)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_vcb,
    stride_vco,
    stride_vch,
    inv_k_scale,
    inv_v_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    FP8: tl.constexpr,
):
    """k_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = key[t] (and v) with slot = slot[t];
    nothing when slot < 0. Program t copies token t's [num_kv_heads, head_dim] rows; FP8:
    stores clamp(key * inv_k_scale, +-448) (and v), rounded to the cache's fp8."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_P)[:, None]
    dims = tl.arange(0, HEAD_DIM_P)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    token64 = token.to(tl.int64)
    k = tl.load(key_ptr + token64 * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token64 * stride_vt + heads * stride_vh + dims, mask=mask)
    if FP8:
        k = _round_fp8(k.to(tl.float32) * inv_k_scale)
        v = _round_fp8(v.to(tl.float32) * inv_v_scale)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kco + heads * stride_kch + dims
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vco + heads * stride_vch + dims
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in fp32. UPCAST (CPU interpreter only): the interpreter multiplies
    bf16 as raw integers, so operands go through fp32 (exact for bf16/fp16 products)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _scores(
    q, k, qk_scale, softcap, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr
):
    """The scores of q @ k in the online softmax's base 2: qk_scale * q @ k (qk_scale =
    scale * log2 e) or, SOFTCAP, softcap * tanh(qk_scale * q @ k) with qk_scale = scale / c
    and softcap = c * log2 e (c tanh(s / c) in base 2), tanh(x) = 2 sigmoid(2x) - 1."""
    s = _dot(q, k, PRECISION, UPCAST) * qk_scale
    if SOFTCAP:
        s = softcap * (2.0 * tl.sigmoid(2.0 * s) - 1.0)
    return s


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    k_base,
    v_base,
    table_row,
    start_n,
    kv_lo,
    kv_len,
    offs_d,
    dim_mask,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    qk_scale,
    softcap,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One online-softmax step over keys start_n .. start_n + TILE_N (those < kv_len and,
    WINDOWED, >= kv_lo; the others are not read).

    s = `_scores` (base 2), masked to -inf for the keys not attended; then with
    m' = max(m, rowmax s), p = 2^(s - m'): l' = l * 2^(m - m') + rowsum p,
    acc' = acc * 2^(m - m') + p @ V.
    """
    offs_n = start_n + tl.arange(0, TILE_N)
    kv_mask = offs_n < kv_len
    if WINDOWED:
        kv_mask = kv_mask & (offs_n >= kv_lo)
    block = tl.load(table_row + offs_n // BLOCK_SIZE, mask=kv_mask, other=0).to(tl.int64)
    in_block = offs_n % BLOCK_SIZE
    k_ptrs = k_base + block[None, :] * stride_kb + in_block[None, :] * stride_kt + offs_d[:, None]
    k = tl.load(k_ptrs, mask=dim_mask[:, None] & kv_mask[None, :], other=0.0)  # [D, TILE_N]
    k = k.to(q.dtype)  # an fp8 cache's values, exactly
    s = _scores(q, k, qk_scale, softcap, SOFTCAP, PRECISION, UPCAST)
    s = tl.where(kv_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v_ptrs = v_base + block[:, None] * stride_vb + in_block[:, None] * stride_vt + offs_d[None, :]
    v = tl.load(v_ptrs, mask=kv_mask[:, None] & dim_mask[None, :], other=0.0)  # [TILE_N, D]
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
    return acc, m_new, l_i


@triton.jit
def _kv_rows(
    table_row,
    start_n,
    kv_len,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,
):
    """The cache row offsets (k and v) of keys start_n .. start_n + TILE_N, reading each
    page's block-table entry once: one entry when the tile lies inside a page (BLOCK_SIZE a
    multiple of TILE_N), one per page when the tile holds whole pages (TILE_N a multiple of
    BLOCK_SIZE), else one per key. MASKED: pages at or past kv_len are not read (entry 0)."""
    offs = tl.arange(0, TILE_N)
    if BLOCK_SIZE % TILE_N == 0:
        block = tl.load(table_row + start_n // BLOCK_SIZE).to(tl.int64)
        in_block = start_n % BLOCK_SIZE + offs
        k_rows = block * stride_kb + in_block * stride_kt
        v_rows = block * stride_vb + in_block * stride_vt
    elif TILE_N % BLOCK_SIZE == 0:
        page = start_n // BLOCK_SIZE + tl.arange(0, TILE_N // BLOCK_SIZE)
        if MASKED:
            blocks = tl.load(table_row + page, mask=page * BLOCK_SIZE < kv_len, other=0)
        else:
            blocks = tl.load(table_row + page)
        # each key's entry from the page's, in registers (a reshape of [pages, BLOCK_SIZE]
        # offsets measured 40% slower on an H200: its layout conversion spills)
        blocks = tl.gather(blocks.to(tl.int64), offs // BLOCK_SIZE, 0)
        in_block = offs % BLOCK_SIZE
        k_rows = blocks * stride_kb + in_block * stride_kt
        v_rows = blocks * stride_vb + in_block * stride_vt
    else:
        offs_n = start_n + offs
        block = tl.load(table_row + offs_n // BLOCK_SIZE, mask=offs_n < kv_len, other=0)
        block = block.to(tl.int64)
        k_rows = block * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt
        v_rows = block * stride_vb + (offs_n % BLOCK_SIZE) * stride_vt
    return k_rows, v_rows


@triton.jit
def _load_rows(
    ptrs,
    row_ok,
    offs_d,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    MASK_ROWS: tl.constexpr,
):
    """ptrs [rows, HEAD_DIM_P] loaded with only the masks needed (rows where MASK_ROWS,
    dims >= HEAD_DIM where head_dim is padded); masked entries are 0."""
    if MASK_ROWS:
        return tl.load(ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if HEAD_DIM == HEAD_DIM_P:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)


@triton.jit
def _prefill_tile(
    q,
    acc,
    m_i,
    l_i,
    k_base,
    v_base,
    table_row,
    start_n,
    kv_lo,
    kv_len,
    query_pos,
    window,
    offs_d,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    qk_scale,
    softcap,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One FlashAttention-2 step over keys start_n .. start_n + TILE_N, in base 2:
    s = `_scores`, m' = max(m, rowmax s), p = 2^(s - m'), l' = l * 2^(m - m') + rowsum p,
    acc' = acc * 2^(m - m') + p @ V.

    Unmasked (not MASKED): every key of the tile is visible to every row, no mask at all.
    MASKED (the diagonal tiles, and WINDOWED the tiles where rows' windows begin): s = -inf
    for keys > query_pos[row] (query_pos < kv_len, so keys past the context are masked too)
    and, WINDOWED, keys <= query_pos[row] - window; K/V rows past kv_len (and, WINDOWED,
    below kv_lo) are not read. Without a window every row sees key 0 in the first tile, so m
    stays finite from then on; with one a row may see no key yet, and m' = -inf is taken as
    0 (p = 0, alpha = 0)."""
    offs_n = start_n + tl.arange(0, TILE_N)
    key_ok = offs_n < kv_len
    if WINDOWED:
        key_ok = key_ok & (offs_n >= kv_lo)
    k_rows, v_rows = _kv_rows(
        table_row, start_n, kv_len, stride_kb, stride_kt, stride_vb, stride_vt,
        BLOCK_SIZE, TILE_N, MASKED,
    )  # fmt: skip
    k_ptrs = k_base + k_rows[:, None] + offs_d[None, :]
    k = _load_rows(k_ptrs, key_ok, offs_d, HEAD_DIM, HEAD_DIM_P, MASKED).to(q.dtype)
    s = _scores(q, tl.trans(k), qk_scale, softcap, SOFTCAP, PRECISION, UPCAST)
    if MASKED:
        visible = offs_n[None, :] <= query_pos[:, None]
        if WINDOWED:
            visible = visible & (offs_n[None, :] > query_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = m_new
    if MASKED and WINDOWED:  # a row may have seen no key yet
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v_ptrs = v_base + v_rows[:, None] + offs_d[None, :]
    v = _load_rows(v_ptrs, key_ok, offs_d, HEAD_DIM, HEAD_DIM_P, MASKED).to(q.dtype)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
    return acc, m_new, l_i


@triton.jit
def _join_sinks(acc, m_i, l_i, sinks_ptr, head, head_mask):
    """(acc, l) of an online softmax's final state (base 2) with each row's sink logit
    sinks[head] joined to the denominator only: s2 = sinks[head] log2 e, m' = max(m, s2),
    acc' = acc 2^(m - m'), l' = l 2^(m - m') + 2^(s2 - m') (m' = -inf is taken as 0, as in
    the key loops; a row that saw no key gets acc' = 0 and, with a finite sink, l' = 1, so
    out = 0). Rows outside head_mask get the sink -inf: (acc, l) unchanged."""
    sink = tl.load(sinks_ptr + head, mask=head_mask, other=float("-inf")) * _LOG2E
    m_new = tl.maximum(m_i, sink)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    return acc * alpha[:, None], l_i * alpha + tl.exp2(sink - m_ref)


@triton.jit
def _find_slot(starts_ptr, x, num_seqs, BLOCK_Q: tl.constexpr):
    """The entry i of the launch order owning program x: the largest i with
    starts[i] // BLOCK_Q + i <= x (entry i owns programs [starts[i] // BLOCK_Q + i,
    starts[i + 1] // BLOCK_Q + i + 1), at least its cdiv(q_len, BLOCK_Q) query blocks)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(starts_ptr + mid) // BLOCK_Q + mid
        if first <= x:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["window", "num_seqs", "stride_bt"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    order_ptr,
    starts_ptr,
    out_ptr,
    sinks_ptr,
    qk_scale,
    softcap,
    v_scale,
    window,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    ORDERED: tl.constexpr,
    SKIP_DECODES: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Causal varlen attention for the query tile (BLOCK_Q queries x GROUP heads) of program
    (x, kv head). Launch order, longest first: entry i of the order is request order[i]
    (ORDERED; else request i) whose queries start at starts[i] in that order (ORDERED: the
    cumulative q_len in that order; else query_start_loc); program x is its query block
    cdiv(q_len, BLOCK_Q) - 1 - (x - starts[i] // BLOCK_Q - i), the last (most keys) first.

    Row r is query qi = first + r // GROUP at position ctx + qi (ctx = seq_len - q_len), head
    kv_head * GROUP + r % GROUP; it attends keys 0 .. ctx + qi (WINDOWED: from
    ctx + qi - window + 1). Key tiles below the tile's first query position need no mask; the
    diagonal tiles (up to ctx + the last query) are masked. WINDOWED: the loop starts at the
    tile of key ctx + first - window + 1 and masks the tiles before key kv_len - window (the
    last query's window start). SINKS: each row's sink, sinks[head], joins its softmax after
    the last tile (`_join_sinks`), before out = acc / l. SKIP_DECODES: requests with one query
    are left to `_decode_kernel`."""
    x = tl.program_id(0)
    kv_head = tl.program_id(1)
    i = _find_slot(starts_ptr, x, num_seqs, BLOCK_Q)
    seq = i
    if ORDERED:
        seq = tl.load(order_ptr + i)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    num_qblocks = tl.cdiv(q_len, BLOCK_Q)
    local = x - (tl.load(starts_ptr + i) // BLOCK_Q + i)
    if local >= num_qblocks:
        return
    if SKIP_DECODES:
        if q_len == 1:
            return
    first = (num_qblocks - 1 - local) * BLOCK_Q
    ctx = tl.load(seq_lens_ptr + seq) - q_len

    rows = tl.arange(0, BLOCK_M)
    query = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (query < q_len)
    offs_d = tl.arange(0, HEAD_DIM_P)
    token = (q_start + query).to(tl.int64)
    q_ptrs = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = _load_rows(q_ptrs, row_mask, offs_d, HEAD_DIM, HEAD_DIM_P, True)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    last = tl.minimum(first + BLOCK_Q, q_len) - 1
    kv_len = ctx + last + 1
    query_pos = tl.minimum(ctx + query, kv_len - 1)  # padding rows: as the last query
    full_end = (ctx + first + 1) // TILE_N * TILE_N  # keys < full_end: visible to every row
    full_start = 0
    kv_lo = 0
    if WINDOWED:  # keys >= kv_lo: seen by some row; keys >= kv_len - window: by every row
        kv_lo = tl.maximum(ctx + first - window + 1, 0)
        full_start = tl.cdiv(tl.maximum(kv_len - window, 0), TILE_N) * TILE_N
        full_start = tl.minimum(full_start, full_end)
        for start_n in range(kv_lo // TILE_N * TILE_N, full_start, TILE_N):
            acc, m_i, l_i = _prefill_tile(
                q, acc, m_i, l_i, k_base, v_base, table_row, start_n, kv_lo, kv_len, query_pos,
                window, offs_d, stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, softcap,
                HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, TILE_N, True, True, SOFTCAP, PRECISION, UPCAST,
            )  # fmt: skip
    for start_n in range(full_start, full_end, TILE_N):
        acc, m_i, l_i = _prefill_tile(
            q, acc, m_i, l_i, k_base, v_base, table_row, start_n, kv_lo, kv_len, query_pos,
            window, offs_d, stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, softcap,
            HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, TILE_N, False, WINDOWED, SOFTCAP, PRECISION, UPCAST,
        )  # fmt: skip
    for start_n in range(full_end, kv_len, TILE_N):
        acc, m_i, l_i = _prefill_tile(
            q, acc, m_i, l_i, k_base, v_base, table_row, start_n, kv_lo, kv_len, query_pos,
            window, offs_d, stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, softcap,
            HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, TILE_N, True, WINDOWED, SOFTCAP, PRECISION, UPCAST,
        )  # fmt: skip

    if SINKS:
        acc, l_i = _join_sinks(acc, m_i, l_i, sinks_ptr, head, row_mask)
    out = acc * (v_scale / l_i)[:, None]
    o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    o_mask = row_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _decode_token(query_start_loc_ptr, seq, MIXED: tl.constexpr):
    """The token row of decode request `seq`: `seq` itself in a decode-only batch; in a mixed
    batch (MIXED) query_start_loc[seq], or -1 if the request has more than one query."""
    token = seq
    if MIXED:
        token = tl.load(query_start_loc_ptr + seq)
        if tl.load(query_start_loc_ptr + seq + 1) - token != 1:
            token = -1
    return token


@triton.jit(do_not_specialize=["window", "tiles_per_split", "num_splits", "stride_bt"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    sinks_ptr,
    qk_scale,
    softcap,
    v_scale,
    window,
    tiles_per_split,
    num_splits,
    num_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DIRECT: tl.constexpr,
    MIXED: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One decode query (token b of request b; MIXED: token query_start_loc[b], and only
    requests with one query) x the GROUP heads of one kv head over split
    `split` of the context: keys [split * tiles_per_split * TILE_N, ...) below seq_len.
    WINDOWED: keys kv_lo = max(seq_len - window, 0) .. seq_len - 1 only, the splits cutting
    the tiles from kv_lo's: keys [(kv_lo // TILE_N + split * tiles_per_split) * TILE_N, ...).

    DIRECT (num_splits == 1): writes out = acc / l, SINKS with each head's sink, sinks[head],
    joined first (`_join_sinks`). Otherwise writes the partial output acc / l to
    part_out[b, head, split, :] and lse = m + log2(l) (base 2, scaled scores) to
    part_lse[b, head, split] (-inf for an empty split) for `_decode_reduce_kernel`, which
    joins the sinks."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = _decode_token(query_start_loc_ptr, seq, MIXED)
    if token < 0:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    tile_start = split * tiles_per_split
    kv_lo = 0
    if WINDOWED:
        kv_lo = tl.maximum(seq_len - window, 0)
        tile_start += kv_lo // TILE_N
    tile_end = tl.minimum(tile_start + tiles_per_split, tl.cdiv(seq_len, TILE_N))

    rows = tl.arange(0, BLOCK_H)
    row_mask = rows < GROUP
    head = kv_head * GROUP + rows
    offs_d = tl.arange(0, HEAD_DIM_P)
    dim_mask = offs_d < HEAD_DIM
    seq64 = seq.to(tl.int64)
    token64 = token.to(tl.int64)
    q_ptrs = q_ptr + token64 * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_P], tl.float32)
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    table_row = block_tables_ptr + seq64 * stride_bt
    for tile in range(tile_start, tile_end):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_base, v_base, table_row, tile * TILE_N, kv_lo, seq_len,
            offs_d, dim_mask, stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, softcap,
            BLOCK_SIZE, TILE_N, WINDOWED, SOFTCAP, PRECISION, UPCAST,
        )  # fmt: skip

    if SINKS and DIRECT:
        acc, l_i = _join_sinks(acc, m_i, l_i, sinks_ptr, head, row_mask)
    out = acc * (v_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
    mask = row_mask[:, None] & dim_mask[None, :]
    if DIRECT:
        o_ptrs = out_ptr + token64 * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = (seq64 * num_heads + head) * num_splits + split  # [BLOCK_H]
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :], out, mask=mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.maximum(l_i, 1e-30)))
        tl.store(part_lse_ptr + part, lse, mask=row_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    out_ptr,
    sinks_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    SPLITS_CHUNK: tl.constexpr,
    MIXED: tl.constexpr,
    SINKS: tl.constexpr,
):
    """out[b, h] = sum_s w_s * o_s / sum_s w_s with w_s = 2^(lse_s - M), M = max lse, over the
    splits of program (b, h); empty splits have lse = -inf and weigh 0. SINKS: the head's sink
    (base 2: s2 = sinks[h] log2 e) joins the denominator once, out = sum_s w_s * o_s /
    (2^(s2 - M) + sum_s w_s), with M = max(max lse, s2). The splits are read SPLITS_CHUNK at a
    time (the max first, then the weighted sum), so one compiled kernel serves any split
    count."""
    token = _decode_token(query_start_loc_ptr, tl.program_id(0), MIXED)
    if token < 0:
        return
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM_P)
    dim_mask = offs_d < HEAD_DIM
    first = (seq * num_heads + head) * num_splits
    lse_max = float("-inf")
    for start in range(0, num_splits, SPLITS_CHUNK):
        splits = start + tl.arange(0, SPLITS_CHUNK)
        lse = tl.load(part_lse_ptr + first + splits, mask=splits < num_splits, other=float("-inf"))
        lse_max = tl.maximum(lse_max, tl.max(lse, axis=0))
    if SINKS:
        sink = tl.load(sinks_ptr + head) * _LOG2E
        lse_max = tl.maximum(lse_max, sink)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    total = 0.0
    acc = tl.zeros([HEAD_DIM_P], tl.float32)
    for start in range(0, num_splits, SPLITS_CHUNK):
        splits = start + tl.arange(0, SPLITS_CHUNK)
        split_mask = splits < num_splits
        lse = tl.load(part_lse_ptr + first + splits, mask=split_mask, other=float("-inf"))
        weight = tl.exp2(lse - lse_max)
        o_ptrs = part_out_ptr + (first + splits)[:, None] * HEAD_DIM_P + offs_d[None, :]
        o = tl.load(o_ptrs, mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
        total += tl.sum(weight, axis=0)
        acc += tl.sum(o * weight[:, None], axis=0)
    if SINKS:
        total += tl.exp2(sink - lse_max)
    out = acc / tl.where(total == 0.0, 1.0, total)
    o_dst = out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_d
    tl.store(o_dst, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


# --------------------------------------------------------------------------- launchers


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """k_cache.view(-1, kv_heads, dim)[slot_mapping[i]] = key[i] (and v) for slot >= 0.

    key, value: [num_tokens, num_kv_heads, head_dim] (token/head strides free, dim contiguous);
    caches: [num_blocks, block_size, num_kv_heads, head_dim], key's dtype or float8_e4m3fn
    (stored divided by k_scale / v_scale); slot_mapping: [num_tokens] int32/int64, negative =
    skip (padding)."""
    _check_cache_pair(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    for name, t in (("key", key), ("value", value)):
        _check(t.dim() == 3, f"{name} must be [num_tokens, num_kv_heads, head_dim]")
        _check(t.shape[1:] == (num_kv_heads, head_dim), f"{name} {tuple(t.shape)} vs cache")
        _check(t.dtype in _FLOAT_DTYPES, f"{name} dtype {t.dtype} unsupported")
        _check(t.dtype == k_cache.dtype or _is_fp8(k_cache),
               f"{name} dtype {t.dtype} != cache {k_cache.dtype}")  # fmt: skip
        _check(t.device == k_cache.device, f"{name} is on {t.device}, cache on {k_cache.device}")
        _check(t.stride(-1) == 1, f"{name} must be contiguous in head_dim")
    _check(key.shape[0] == value.shape[0], "key and value token counts differ")
    _check(slot_mapping.shape == (key.shape[0],), "slot_mapping must be [num_tokens]")
    _check(slot_mapping.dtype in _INDEX_DTYPES, "slot_mapping must be int32 or int64")
    _check(slot_mapping.device == key.device, "slot_mapping is on another device")
    if key.shape[0] == 0:
        return
    _write_kv_cache_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), 1.0 / k_scale, 1.0 / v_scale,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        HEADS_P=triton.next_power_of_2(num_kv_heads), HEAD_DIM_P=_head_dim_padded(head_dim),
        FP8=_is_fp8(k_cache), num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )  # fmt: skip


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    prefill_tiles: PrefillTiles | None = None,
    longest_first: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal paged attention over a mixed batch; returns out [num_tokens, heads, dim].

    q: [num_tokens, num_heads, head_dim], request b's queries at rows
    query_start_loc[b] : query_start_loc[b + 1]; seq_lens[b] counts its context including
    this step's tokens (already in the cache); block_tables [batch, max_blocks] int32.
    max_query_len == 1 (all decodes: token b is request b): the split-K decode kernels only.
    Otherwise the prefill kernel takes the requests with more than one query and the decode
    kernels (token query_start_loc[b]) those with one. max_seq_len (host int, optional)
    bounds the context to size the splits, else max_blocks * block_size does; num_splits
    forces the split count (tests, tuning); k_scale / v_scale: an fp8 cache's scales;
    window, softcap: the layer's sliding window and logit softcap (0: none; the module doc);
    sinks: the layer's sink logits, [num_heads] float32 contiguous on q's device (None: none);
    prefill_tiles: the prefill kernel's launch configuration (default: `prefill_tiles(...)`);
    longest_first: the step's launch order (attention_metadata.longest_first_order, [2 * batch
    + 1] int32), else requests in batch order (each request's last query block first)."""
    _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    _check(max_query_len >= 1, "max_query_len must be >= 1")
    _check(window >= 0 and softcap >= 0.0, "window and softcap must be >= 0")
    if sinks is not None:
        _check_sinks(sinks, q)
    if out is None:
        out = torch.empty_like(q)
    _check(out.shape == q.shape and out.dtype == q.dtype, "out must match q's shape and dtype")
    _check(out.device == q.device and out.stride(-1) == 1, "out: q's device, dim contiguous")
    if q.shape[0] == 0:
        return out
    mixed = max_query_len > 1
    layer = _LayerArgs.of(scale * k_scale, v_scale, window, softcap, sinks)
    if not mixed:
        _check(q.shape[0] == seq_lens.shape[0], "decode (max_query_len 1): one token a request")
    else:
        tiles = prefill_tiles or _default_prefill_tiles(q, k_cache, max_query_len)
        _launch_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                        longest_first, out, layer, tiles)  # fmt: skip
    _launch_decode(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, layer,
                   max_seq_len, num_splits, mixed)  # fmt: skip
    return out


def paged_attention_backend(
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
    """The backends' common signature (attention_backends.AttentionFn)."""
    return paged_attention(
        q,
        k_cache,
        v_cache,
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        metadata.max_query_len,
        scale,
        max_seq_len=metadata.max_seq_len,
        k_scale=k_scale,
        v_scale=v_scale,
        window=window,
        softcap=softcap,
        sinks=sinks,
        longest_first=metadata.longest_first,
    )


@dataclass(frozen=True)
class _LayerArgs:
    """A layer's arguments to the attention kernels: qk_scale and softcap as `_scores` takes
    them (SOFTCAP: softcap > 0), v_scale (multiplies the output), window (WINDOWED: > 0),
    sinks (SINKS: not None; natural-log logits, the kernels take them to base 2)."""

    qk_scale: float
    softcap: float
    v_scale: float
    window: int
    sinks: torch.Tensor | None

    @classmethod
    def of(
        cls,
        scale: float,
        v_scale: float,
        window: int,
        softcap: float,
        sinks: torch.Tensor | None,
    ) -> _LayerArgs:
        """scale: the softmax scale (times k_scale); softcap: c (0: none). The scores go to
        base 2: scale * log2 e, or with c, scale / c inside the tanh and c * log2 e outside."""
        if softcap:
            return cls(scale / softcap, softcap * LOG2E, v_scale, window, sinks)
        return cls(scale * LOG2E, 0.0, v_scale, window, sinks)

    def sinks_arg(self, unused: torch.Tensor) -> torch.Tensor:
        """The kernels' sinks_ptr: the sinks, else `unused` (not read: SINKS is off)."""
        return unused if self.sinks is None else self.sinks


def _launch_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    longest_first: torch.Tensor | None,
    out: torch.Tensor,
    layer: _LayerArgs,
    tiles: PrefillTiles,
) -> None:
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    batch = seq_lens.shape[0]
    _check_prefill_tiles(tiles, group)
    block_q = tiles.block_m // group
    if longest_first is None:
        order, starts = query_start_loc, query_start_loc  # order unused (ORDERED False)
    else:
        _check(longest_first.shape == (2 * batch + 1,) and longest_first.dtype == torch.int32,
               "longest_first must be [2 * batch + 1] int32")  # fmt: skip
        _check(longest_first.device == q.device, "longest_first is on another device")
        order, starts = longest_first[:batch], longest_first[batch:]
    grid = (num_tokens // block_q + batch, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, order, starts, out,
        layer.sinks_arg(q), layer.qk_scale, layer.softcap, layer.v_scale, layer.window, batch,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, BLOCK_M=tiles.block_m, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        HEAD_DIM_P=_head_dim_padded(head_dim), BLOCK_SIZE=block_size, TILE_N=tiles.block_n,
        ORDERED=longest_first is not None, SKIP_DECODES=True, WINDOWED=layer.window > 0,
        SOFTCAP=layer.softcap > 0.0, SINKS=layer.sinks is not None,
        PRECISION=_precision(q.dtype), UPCAST=_upcast(q),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip


def _launch_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    layer: _LayerArgs,
    max_seq_len: int | None,
    num_splits: int | None,
    mixed: bool,
) -> None:
    """Flash-decoding for the one-query requests (all of them unless `mixed`). The splits
    share the tiles a request's keys span, with a window those of its window (at most
    cdiv(window - 1, TILE_N) + 1)."""
    _, num_heads, head_dim = q.shape
    batch = seq_lens.shape[0]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    tile_n, num_warps, num_stages = DECODE_TUNING
    max_ctx = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
    num_tiles = max(1, triton.cdiv(max_ctx, tile_n))
    if layer.window:
        num_tiles = min(num_tiles, triton.cdiv(layer.window - 1, tile_n) + 1)
    if num_splits is None:
        num_splits = _decode_num_splits(batch * num_kv_heads, num_tiles, q.device)
    _check(num_splits >= 1, "num_splits must be >= 1")
    tiles_per_split = triton.cdiv(num_tiles, num_splits)
    num_splits = triton.cdiv(num_tiles, tiles_per_split)
    head_dim_p = _head_dim_padded(head_dim)
    if num_splits > 1:
        part_out = torch.empty(
            (batch, num_heads, num_splits, head_dim_p), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, part_out, part_lse,
        layer.sinks_arg(q), layer.qk_scale, layer.softcap, layer.v_scale, layer.window,
        tiles_per_split, num_splits, num_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p, BLOCK_SIZE=block_size, TILE_N=tile_n, DIRECT=num_splits == 1,
        MIXED=mixed, WINDOWED=layer.window > 0, SOFTCAP=layer.softcap > 0.0,
        SINKS=layer.sinks is not None, PRECISION=_precision(q.dtype), UPCAST=_upcast(q),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            part_out, part_lse, query_start_loc, out, layer.sinks_arg(q), out.stride(0),
            out.stride(1), num_heads, num_splits, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
            SPLITS_CHUNK=32, MIXED=mixed, SINKS=layer.sinks is not None,
            num_warps=4 if head_dim_p >= 128 else 1,
        )  # fmt: skip


# --------------------------------------------------------------------------- sizing and checks


def _default_prefill_tiles(
    q: torch.Tensor, k_cache: torch.Tensor, max_query_len: int
) -> PrefillTiles:
    group = q.shape[1] // k_cache.shape[2]
    return prefill_tiles(q.device, q.shape[2], group, max_query_len)


def _check_prefill_tiles(tiles: PrefillTiles, group: int) -> None:
    for name in ("block_m", "block_n"):
        size = getattr(tiles, name)
        _check(size >= 16 and size & (size - 1) == 0, f"{name} must be a power of two >= 16")
    _check(tiles.block_m >= group, f"block_m {tiles.block_m} < the head group {group}")
    _check(tiles.num_warps >= 1 and tiles.num_stages >= 1, "num_warps, num_stages must be >= 1")


def _decode_num_splits(num_programs: int, num_tiles: int, device: torch.device) -> int:
    """Enough splits for about 2 programs per SM (flash-decoding), none when the batch alone
    fills the GPU; at least 2 tiles of keys per split."""
    sms = _num_sms(device.index) if device.type == "cuda" else 4
    want = triton.cdiv(2 * sms, num_programs)
    return max(1, min(want, num_tiles // 2, _MAX_SPLITS))


@functools.cache
def _num_sms(index: int | None) -> int:
    device = torch.cuda.current_device() if index is None else index
    return torch.cuda.get_device_properties(device).multi_processor_count


def _head_dim_padded(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs: exact fp32 products (no TF32) so the kernel matches the fp32 reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.bfloat16


def _is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float8_e4m3fn


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_sinks(sinks: torch.Tensor, q: torch.Tensor) -> None:
    _check(sinks.shape == (q.shape[1],), f"sinks must be [num_heads] = [{q.shape[1]}]")
    _check(sinks.dtype == torch.float32, "sinks must be float32")
    _check(sinks.device == q.device, f"sinks is on {sinks.device}, q on {q.device}")
    _check(sinks.is_contiguous(), "sinks must be contiguous")


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    _check(k_cache.dim() == 4, "caches must be [num_blocks, block_size, num_kv_heads, head_dim]")
    _check(k_cache.shape == v_cache.shape, "k_cache and v_cache shapes differ")
    _check(k_cache.dtype == v_cache.dtype, "k_cache and v_cache dtypes differ")
    _check(k_cache.dtype in _CACHE_DTYPES, f"cache dtype {k_cache.dtype} unsupported")
    _check(k_cache.device == v_cache.device, "k_cache and v_cache devices differ")
    _check(k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "caches: dim contiguous")
    _check(k_cache.shape[-1] <= _MAX_HEAD_DIM, f"head_dim > {_MAX_HEAD_DIM} unsupported")


def _check_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    _check_cache_pair(k_cache, v_cache)
    _check(q.dim() == 3, "q must be [num_tokens, num_heads, head_dim]")
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    _check(head_dim == k_cache.shape[3], f"q head_dim {head_dim} != cache {k_cache.shape[3]}")
    _check(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads")
    _check(q.dtype in _FLOAT_DTYPES, f"q dtype {q.dtype} unsupported")
    _check(q.dtype == k_cache.dtype or _is_fp8(k_cache),
           f"q dtype {q.dtype} != cache dtype {k_cache.dtype}")  # fmt: skip
    _check(q.stride(-1) == 1, "q must be contiguous in head_dim")
    _check(block_tables.dim() == 2 and block_tables.dtype == torch.int32,
           "block_tables must be [batch, max_blocks] int32")  # fmt: skip
    _check(block_tables.stride(1) == 1, "block_tables rows must be contiguous")
    batch = block_tables.shape[0]
    _check(seq_lens.shape == (batch,) and seq_lens.dtype == torch.int32,
           "seq_lens must be [batch] int32")  # fmt: skip
    _check(query_start_loc.shape == (batch + 1,) and query_start_loc.dtype == torch.int32,
           "query_start_loc must be [batch + 1] int32")  # fmt: skip
    _check(seq_lens.is_contiguous() and query_start_loc.is_contiguous(),
           "seq_lens and query_start_loc must be contiguous")  # fmt: skip
    for name, t in (("k_cache", k_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):  # fmt: skip
        _check(t.device == q.device, f"{name} is on {t.device}, q on {q.device}")
