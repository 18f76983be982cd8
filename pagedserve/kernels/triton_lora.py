"""LoRA deltas for a step's tokens, each token with its own adapter slot, in two launches that
read the slots on the device (so a CUDA graph replays them for any mix of adapters): punica's
"shrink" and "expand".

Math, for token t with slot s = slots[t] (s < 0: no adapter; nothing is added):
  shrink  h[t, p, r] = sum_k A[s, p, r, k] x[t, k]          A [slots, parts, R, K], x [T, K]
  expand  y[t, o] += sum_r B[s, o, r] h[t, part(o), r]       B [slots, N, R], y [T, N]
h in fp32; part(o) the fused part whose output rows hold o (the parts' rows one after another,
ending at `part_ends`). Program (t, p) of the shrink reads x[t] once and A[s, p] in BLOCK_K
columns; program (t, j) of the expand adds BLOCK_N outputs. Each token reads its slot's A and
B (from L2 when tokens share a slot): the path for decode-sized steps; large prefill steps
take the grouped torch path (models/lora.py).

The reference (and the CPU path's definition) is `reference_lora_delta`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["add_lora_delta", "reference_lora_delta"]

_BLOCK_K = 256
_BLOCK_N = 64
_MAX_PARTS = 3


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slots_ptr, h_ptr, K,
    stride_x, stride_as, stride_ap, stride_ar, stride_h,
    R: tl.constexpr, PARTS: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """h[t, p, :] = A[slots[t], p] x[t] (zeros for a token without an adapter)."""
    t = tl.program_id(0)
    p = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    r = tl.arange(0, R)
    acc = tl.zeros([R], dtype=tl.float32)
    if slot >= 0:
        a_row = a_ptr + slot.to(tl.int64) * stride_as + p * stride_ap + r[:, None] * stride_ar
        x_row = x_ptr + t.to(tl.int64) * stride_x
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            inside = k < K
            x = tl.load(x_row + k, mask=inside, other=0.0).to(tl.float32)
            a = tl.load(a_row + k[None, :], mask=inside[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + t.to(tl.int64) * stride_h + p * R + r, acc)


@triton.jit
def _expand_kernel(
    h_ptr, b_ptr, slots_ptr, y_ptr, N, end0, end1,
    stride_h, stride_bs, stride_bn, stride_y,
    R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """y[t, o] += B[slots[t], o] . h[t, part(o)] for BLOCK_N outputs o (none without an
    adapter); part(o) = (o >= end0) + (o >= end1)."""
    t = tl.program_id(0)
    j = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        o = j * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = o < N
        r = tl.arange(0, R)
        part = (o >= end0).to(tl.int32) + (o >= end1).to(tl.int32)
        h_rows = h_ptr + t.to(tl.int64) * stride_h + part[:, None] * R + r[None, :]
        h = tl.load(h_rows, mask=inside[:, None], other=0.0)
        b_rows = b_ptr + slot.to(tl.int64) * stride_bs + o[:, None] * stride_bn + r[None, :]
        b = tl.load(b_rows, mask=inside[:, None], other=0.0).to(tl.float32)
        delta = tl.sum(b * h, axis=1)
        y_row = y_ptr + t.to(tl.int64) * stride_y + o
        y = tl.load(y_row, mask=inside, other=0.0)
        tl.store(y_row, (y.to(tl.float32) + delta).to(y.dtype), mask=inside)


def add_lora_delta(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    part_sizes: list[int],
) -> None:
    """y += the LoRA delta of each token's slot (module doc), in place. x [T, K], y [T, N]
    (rows contiguous), a [S, parts, R, K] and b [S, N, R] contiguous with R a power of two
    >= 16, slots [>= T] int32 (its first T entries are the tokens')."""
    t, k = x.shape
    s, parts, r, k_a = a.shape
    if y.shape[0] != t or y.shape[1] != sum(part_sizes) or b.shape != (s, y.shape[1], r):
        raise ValueError(f"shapes x {tuple(x.shape)}, y {tuple(y.shape)}, b {tuple(b.shape)}")
    if k_a != k or parts != len(part_sizes) or not 1 <= parts <= _MAX_PARTS:
        raise ValueError(f"a {tuple(a.shape)} does not fit x {tuple(x.shape)} / parts")
    if r < 16 or r & (r - 1) or not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("a and b must be contiguous with a power-of-two rank of at least 16")
    if x.stride(1) != 1 or y.stride(1) != 1 or slots.dtype != torch.int32 or len(slots) < t:
        raise ValueError("x and y need unit column strides, slots T int32 entries")
    if t == 0:
        return
    h = torch.empty(t, parts * r, dtype=torch.float32, device=x.device)
    _shrink_kernel[(t, parts)](
        x, a, slots, h, k, x.stride(0), a.stride(0), a.stride(1), a.stride(2), h.stride(0),
        R=r, PARTS=parts, BLOCK_K=_BLOCK_K,
    )  # fmt: skip
    ends = [sum(part_sizes[: i + 1]) for i in range(parts)] + [y.shape[1]] * 2
    _expand_kernel[(t, triton.cdiv(y.shape[1], _BLOCK_N))](
        h, b, slots, y, y.shape[1], ends[0], ends[1], h.stride(0), b.stride(0), b.stride(1),
        y.stride(0), R=r, BLOCK_N=_BLOCK_N,
    )  # fmt: skip


def reference_lora_delta(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    part_sizes: list[int],
) -> torch.Tensor:
    """The delta [T, N] in fp32, token by token."""
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
