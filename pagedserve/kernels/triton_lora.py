"""LoRA deltas for a step's tokens, each token with its own adapter slot, in two launches that
read the tokens' slots on the device (so a CUDA graph replays them for any mix of adapters):
punica's "shrink" and "expand", in the segmented form (SGMV) that multiplies each slot's tokens
as one block on the tensor cores.

Math, for token t with slot s (tokens without an adapter are in no slot; nothing is added):
  shrink  h[t, p, r] = sum_k A[s, p, r, k] x[t, k]          A [slots, parts, R, K], x [T, K]
  expand  y[t, o] += sum_r B[s, o, r] h[t, part(o), r]       B [slots, N, R], y [T, N]
h in fp32; part(o) the fused part whose output rows hold o (the parts' rows one after another,
ending at `part_ends`). The tokens come sorted by slot (`order`, with slot s's tokens at
order[starts[s] : starts[s + 1]]), so program (m, ., s) takes the m-th block of BLOCK_M tokens
of slot s and reads that slot's A or B once for the block: a [BLOCK_M, BLOCK_K] x [BLOCK_K, R]
dot per column block in the shrink, [BLOCK_M, R] x [R, BLOCK_N] in the expand. The grids cover
every slot and the step's whole row count; programs past their slot's tokens return at once.
A small step splits the shrink's K over SPLIT_K programs (partial sums in h's first axis, which
the expand adds up) so that a lone token's delta is not one program's serial walk over K.

The reference (and the CPU path's definition) is `reference_lora_delta`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton_dot import accumulate_dot

__all__ = ["add_lora_delta", "reference_lora_delta"]

_BLOCK_K = 128
_BLOCK_N = 128
_MAX_PARTS = 3
_MAX_SPLIT_K = 8
_SMALL_STEP = 16  # tokens: up to this many, BLOCK_M 16 and the shrink's K split


@triton.jit
def _slot_block(order_ptr, starts_ptr, s, m, BLOCK_M: tl.constexpr):
    """The m-th block of slot s's tokens: (their indices, which are real, whether the block
    holds any)."""
    start = tl.load(starts_ptr + s)
    count = tl.load(starts_ptr + s + 1) - start
    i = m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = i < count
    tokens = tl.load(order_ptr + start + i, mask=valid, other=0).to(tl.int64)
    return tokens, valid, m * BLOCK_M < count


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, order_ptr, starts_ptr, h_ptr, K,
    stride_x, stride_as, stride_ap, stride_ar, stride_hs, stride_ht,
    R: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """h[split, t, p, :] = sum over this split's columns k of x[t, k] A[s, p, :, k], for the
    m-th block of slot s's tokens t (program (m, p * SPLIT_K + split, s))."""
    m = tl.program_id(0)
    p = tl.program_id(1) // SPLIT_K
    split = tl.program_id(1) % SPLIT_K
    s = tl.program_id(2)
    tokens, valid, has_tokens = _slot_block(order_ptr, starts_ptr, s, m, BLOCK_M)
    if has_tokens:
        r = tl.arange(0, R)
        x_rows = x_ptr + tokens[:, None] * stride_x
        a_cols = a_ptr + s.to(tl.int64) * stride_as + p * stride_ap + r[None, :] * stride_ar
        acc = tl.zeros([BLOCK_M, R], dtype=tl.float32)
        for k0 in range(split * BLOCK_K, K, SPLIT_K * BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            inside = k < K
            x = tl.load(x_rows + k[None, :], mask=valid[:, None] & inside[None, :], other=0.0)
            a = tl.load(a_cols + k[:, None], mask=inside[:, None], other=0.0)  # [BLOCK_K, R]
            acc = accumulate_dot(x, a, acc, PRECISION, UPCAST)
        h_rows = h_ptr + split * stride_hs + tokens[:, None] * stride_ht + p * R + r[None, :]
        tl.store(h_rows, acc, mask=valid[:, None])


@triton.jit
def _expand_kernel(
    h_ptr, b_ptr, order_ptr, starts_ptr, y_ptr, N, end0, end1,
    stride_hs, stride_ht, stride_bs, stride_bn, stride_y,
    R: tl.constexpr, PARTS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """y[t, o] += h[t, part(o)] . B[s, o] for BLOCK_N outputs o (program (m, j, s)); h summed
    over its K splits; part(o) = (o >= end0) + (o >= end1); only the parts this block's
    outputs fall in are multiplied."""
    m = tl.program_id(0)
    j = tl.program_id(1)
    s = tl.program_id(2)
    tokens, valid, has_tokens = _slot_block(order_ptr, starts_ptr, s, m, BLOCK_M)
    if has_tokens:
        o = j * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = o < N
        r = tl.arange(0, R)
        part = (o >= end0).to(tl.int32) + (o >= end1).to(tl.int32)
        last = tl.minimum(j * BLOCK_N + BLOCK_N, N) - 1
        first_part = (j * BLOCK_N >= end0).to(tl.int32) + (j * BLOCK_N >= end1).to(tl.int32)
        last_part = (last >= end0).to(tl.int32) + (last >= end1).to(tl.int32)
        b_rows = b_ptr + s.to(tl.int64) * stride_bs + o[None, :] * stride_bn + r[:, None]
        b = tl.load(b_rows, mask=inside[None, :], other=0.0)  # [R, BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for q in tl.static_range(PARTS):
            if (first_part <= q) & (q <= last_part):
                h = tl.zeros([BLOCK_M, R], dtype=tl.float32)
                for split in tl.static_range(SPLIT_K):
                    h_rows = h_ptr + split * stride_hs + tokens[:, None] * stride_ht + q * R
                    h += tl.load(h_rows + r[None, :], mask=valid[:, None], other=0.0)
                d = accumulate_dot(h.to(b.dtype), b, tl.zeros_like(acc), PRECISION, UPCAST)
                acc += tl.where((part == q)[None, :], d, 0.0)
        y_rows = y_ptr + tokens[:, None] * stride_y + o[None, :]
        mask = valid[:, None] & inside[None, :]
        y = tl.load(y_rows, mask=mask, other=0.0)
        tl.store(y_rows, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def add_lora_delta(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    order: torch.Tensor,
    starts: torch.Tensor,
    part_sizes: list[int],
) -> None:
    """y += the LoRA delta of each token's slot (module doc), in place. x [T, K], y [T, N]
    (rows contiguous), a [S, parts, R, K] and b [S, N, R] contiguous with R a power of two
    >= 16; `order` int32 (at least T entries) the tokens with an adapter sorted by slot and
    `starts` [S + 1] int32 where each slot's run begins (models/lora.py's `tokens_by_slot`)."""
    t, k = x.shape
    s, parts, r, k_a = a.shape
    if y.shape[0] != t or y.shape[1] != sum(part_sizes) or b.shape != (s, y.shape[1], r):
        raise ValueError(f"shapes x {tuple(x.shape)}, y {tuple(y.shape)}, b {tuple(b.shape)}")
    if k_a != k or parts != len(part_sizes) or not 1 <= parts <= _MAX_PARTS:
        raise ValueError(f"a {tuple(a.shape)} does not fit x {tuple(x.shape)} / parts")
    if r < 16 or r & (r - 1) or not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("a and b must be contiguous with a power-of-two rank of at least 16")
    if x.stride(1) != 1 or y.stride(1) != 1 or x.dtype != a.dtype or b.dtype != a.dtype:
        raise ValueError("x and y need unit column strides, x, a and b one dtype")
    if order.dtype != torch.int32 or starts.dtype != torch.int32:
        raise ValueError("order and starts must be int32")
    if len(order) < t or starts.shape != (s + 1,):
        raise ValueError(f"order needs {t} entries and starts {s + 1}")
    if t == 0:
        return
    small = t <= _SMALL_STEP
    block_m = 16 if small else 64
    split_k = min(_MAX_SPLIT_K, triton.cdiv(k, _BLOCK_K)) if small else 1
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 models: exact products
    upcast = x.device.type == "cpu" and x.dtype != torch.float32  # the interpreter
    h = torch.empty(split_k, t, parts * r, dtype=torch.float32, device=x.device)
    m_blocks = triton.cdiv(t, block_m)
    _shrink_kernel[(m_blocks, parts * split_k, s)](
        x, a, order, starts, h, k, x.stride(0), a.stride(0), a.stride(1), a.stride(2),
        h.stride(0), h.stride(1),
        R=r, SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_K=_BLOCK_K, PRECISION=precision,
        UPCAST=upcast,
    )  # fmt: skip
    n = y.shape[1]
    ends = [sum(part_sizes[: i + 1]) for i in range(parts)] + [n] * 2
    _expand_kernel[(m_blocks, triton.cdiv(n, _BLOCK_N), s)](
        h, b, order, starts, y, n, ends[0], ends[1], h.stride(0), h.stride(1), b.stride(0),
        b.stride(1), y.stride(0),
        R=r, PARTS=parts, SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_N=_BLOCK_N,
        PRECISION=precision, UPCAST=upcast,
    )  # fmt: skip


def reference_lora_delta(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    part_sizes: list[int],
) -> torch.Tensor:
    """The delta [T, N] in fp32, token by token (slots [T]: each token's slot, -1 none)."""
    t = x.shape[0]
    out = torch.zeros(t, b.shape[1], dtype=torch.float32)
    for i in range(t):
        slot = int(slots[i])
        if slot < 0:
            continue
        start = 0
        for part, size in enumerate(part_sizes):
            h = a[slot, part].float() @ x[i].float()
            out[i, start : start + size] = b[slot, start : start + size].float() @ h
            start += size
    return out
