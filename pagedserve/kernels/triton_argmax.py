"""Greedy sampling's argmax over the vocabulary, split across programs so that a small batch
reads its logits at the GPU's bandwidth (torch's argmax runs one CTA a row: ~30 µs for one row
of Llama-3's 128,256 logits on an H200, against ~2 µs of HBM reads).

Math: out[r] = min { i : x[r, i] = max_j x[r, j] } (the first index of the maximum, as
torch.argmax), NaN counted as +inf. Program (r, s) of an (M, S) grid scans columns
[s * chunk, (s + 1) * chunk) in BLOCK-wide steps, each lane keeping the first maximum of its
columns (replaced only by a strictly larger value), then takes the largest of the lanes' maxima
and the smallest index among equal ones, and stores that (maximum, index) pair;
the LAST program of row r to arrive (an acq_rel counter per row, triton_gemv's per-device
counters) takes the largest maximum of the S pairs and, among equal maxima, the smallest index,
writes out[r] and resets the counter. One launch, no second reduction kernel, and the result
does not depend on the arrival order. With S = 1 the program writes out[r] directly.

CUDA graphs: the grid comes from the shapes only; the pair workspace from torch's caching
allocator. Programmatic dependent launch (`dependent_launch`): every program waits for the
kernel before it (the LM head) before it reads the logits.

The reference (and the CPU path) is torch.argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton_gemv import _counters, _num_sms
from pagedserve.kernels.triton_ops import await_inputs

__all__ = ["greedy_argmax", "reference_argmax"]

_BLOCK = 1024
_PROGRAMS_PER_SM = 2
_MAX_SPLITS = 256


@triton.jit
def _argmax_kernel(
    x_ptr,
    out_ptr,
    best_ptr,
    index_ptr,
    counter_ptr,
    V,
    stride_x,
    chunk,
    BLOCK: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[r] = the first index of row r's maximum (NaN as +inf); program (r, s) covers
    columns [s * chunk, min(V, (s + 1) * chunk)), chunk a multiple of BLOCK."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    await_inputs(PDL)
    row_ptr = x_ptr + row.to(tl.int64) * stride_x
    start = split * chunk
    end = tl.minimum(start + chunk, V)
    cols = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), -float("inf"), tl.float32)  # per lane: its columns' first maximum
    best_index = tl.full((BLOCK,), 0, tl.int32) + start  # a chunk of -inf only: its first column
    for offset in range(start, end, BLOCK):
        x = tl.load(row_ptr + offset + cols, mask=offset + cols < end, other=-float("inf"))
        x = x.to(tl.float32)
        x = tl.where(x != x, float("inf"), x)
        better = x > best
        best_index = tl.where(better, offset + cols, best_index)
        best = tl.where(better, x, best)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, best_index, end), axis=0)
    if num_splits == 1:
        tl.store(out_ptr + row, first.to(tl.int64))
    else:
        pair = row * num_splits + split
        tl.store(best_ptr + pair, top)
        tl.store(index_ptr + pair, first)
        tl.debug_barrier()  # the pair is written before the release below
        arrived = tl.atomic_add(counter_ptr + row, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            splits = tl.arange(0, SPLITS_POW2)
            ok = splits < num_splits
            pairs = row * num_splits + splits
            bests = tl.load(best_ptr + pairs, mask=ok, other=-float("inf"), cache_modifier=".cg")
            indices = tl.load(index_ptr + pairs, mask=ok, other=V, cache_modifier=".cg")
            top = tl.max(bests, axis=0)
            first = tl.min(tl.where(ok & (bests == top), indices, V), axis=0)
            tl.store(out_ptr + row, first.to(tl.int64))
            tl.store(counter_ptr + row, 0)


def greedy_argmax(
    logits: torch.Tensor, out: torch.Tensor, *, dependent_launch: bool = False
) -> torch.Tensor:
    """out[r] = torch.argmax(logits[r]) for logits [M, V] (fp16 / bf16 / fp32, unit column
    stride) into out [M] (int64); returns out. dependent_launch: launch as a programmatic
    dependent of the kernel before it (sm_90+)."""
    _check(logits.dim() == 2 and logits.stride(1) == 1, "logits [M, V] with unit column stride")
    _check(logits.dtype in (torch.float16, torch.bfloat16, torch.float32),
           f"dtype {logits.dtype} unsupported")  # fmt: skip
    m, v = logits.shape
    _check(v >= 1, "an empty vocabulary has no argmax")
    _check(out.shape == (m,) and out.dtype == torch.int64 and out.stride(0) == 1,
           f"out must be [{m}] int64, contiguous")  # fmt: skip
    _check(out.device == logits.device, "out must be on the logits' device")
    if m == 0:
        return out
    blocks = triton.cdiv(v, _BLOCK)
    wanted = triton.cdiv(_PROGRAMS_PER_SM * _num_sms(logits.device), m)
    splits = max(1, min(blocks, _MAX_SPLITS, wanted))
    counters = _counters(logits.device) if splits > 1 else out
    if counters is None or m > counters.numel():  # first use inside a graph capture, huge M
        splits, counters = 1, out
    chunk = triton.cdiv(blocks, splits) * _BLOCK
    splits = triton.cdiv(v, chunk)  # every split holds columns
    best = torch.empty(m * splits if splits > 1 else 1, dtype=torch.float32,
                       device=logits.device)  # fmt: skip
    index = torch.empty(best.shape, dtype=torch.int32, device=logits.device)
    _argmax_kernel[(m, splits)](
        logits, out, best, index, counters, v, logits.stride(0), chunk, BLOCK=_BLOCK,
        SPLITS_POW2=triton.next_power_of_2(splits), PDL=dependent_launch,
        launch_pdl=dependent_launch, num_warps=4,
    )  # fmt: skip
    return out


def reference_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The kernel's meaning in torch: the first index of each row's maximum, NaN as +inf."""
    return torch.nan_to_num(logits.float(), nan=float("inf")).argmax(dim=-1)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
