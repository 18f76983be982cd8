"""A mixture-of-experts feed-forward for a step's tokens in two grouped GEMMs, on the tensor
cores, the routing read on the device (so a CUDA graph replays it for any routing).

Math (kernels.moe_ref, the reference): token t routed to experts e_1 .. e_k with weights
w_1 .. w_k gives

    y[t] = sum_j w_j * W2[e_j] (silu(W1[e_j] x[t]) * W3[e_j] x[t])      w13[e] = [W1; W3]

Each (token, slot) pair p = t * k + j is one row of the work. `align_by_expert` sorts the pairs
by expert and pads each expert's run to a multiple of BLOCK_M (padding entries hold the pair
count, an out-of-range index), so that every block of BLOCK_M sorted entries belongs to one
expert; `block_experts[b]` names it and `num_blocks` counts the blocks in use. The grid covers
the most blocks any routing can need, cdiv(P, BLOCK_M) + min(E, P); programs past `num_blocks`
return at once.

  GEMM 1  h[p] = x[p // k] . w13[e]^T      [BLOCK_M, H] x [H, BLOCK_N] per program
  act     g[p] = silu(h[p, :I]) * h[p, I:]
  GEMM 2  z[p] = w_p * (g[p] . w2[e]^T)    [BLOCK_M, I] x [I, BLOCK_N], z in float32
  y[t] = sum_j z[t * k + j]

so each expert's weights are read once per block of its tokens. Accumulation is float32;
float32 models multiply exactly (`ieee`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton_ops import silu_and_mul

__all__ = ["ExpertBlocks", "align_by_expert", "fused_experts"]

_SMALL_STEP = 64  # (token, slot) pairs: up to this many, the small-step tiles


@dataclass(frozen=True)
class _Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int


_SMALL_TILES = _Tiles(block_m=16, block_n=64, block_k=128, num_warps=4)
_LARGE_TILES = _Tiles(block_m=64, block_n=128, block_k=64, num_warps=8)


@dataclass(frozen=True)
class ExpertBlocks:
    """The pairs sorted by expert in blocks of block_m (module doc): `pairs` [max_blocks *
    block_m] int32 (padding: the pair count), `block_experts` [max_blocks] int32, `num_blocks`
    [1] int32 (the blocks in use)."""

    pairs: torch.Tensor
    block_experts: torch.Tensor
    num_blocks: torch.Tensor
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_experts.shape[0]


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """The (token, slot) pairs of topk_ids [T, k] sorted by expert, each expert's run padded to
    a multiple of block_m. Device ops only (no host sync), so it runs inside a CUDA graph."""
    experts = topk_ids.reshape(-1).long()
    num_pairs = experts.numel()
    device = experts.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    order = torch.argsort(experts, stable=True)  # pair indices, grouped by expert
    sorted_experts = experts[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    destination = (padded_ends - padded)[sorted_experts] + rank
    max_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    pairs = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    pairs[destination] = order.to(torch.int32)
    block_starts = torch.arange(max_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts = block_experts.clamp_(max=num_experts - 1).to(torch.int32)
    num_blocks = (padded_ends[-1:] // block_m).to(torch.int32)
    return ExpertBlocks(pairs, block_experts, num_blocks, block_m)


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b in fp32. UPCAST (the CPU interpreter, which multiplies bf16 as raw
    integers): the operands through fp32, exact for bf16 products."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _expert_gemm_kernel(
    a_ptr, w_ptr, out_ptr, pairs_ptr, block_experts_ptr, num_blocks_ptr, weights_ptr,
    num_pairs, N, K, stride_a, stride_we, stride_wn, stride_out,
    PAIRS_PER_ROW: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """out[p, n] = (weights[p] *) sum_k a[p // PAIRS_PER_ROW, k] w[e, n, k] for the pairs p of
    sorted block m (expert e) and BLOCK_N outputs n (program (m, j))."""
    m = tl.program_id(0)
    j = tl.program_id(1)
    if m < tl.load(num_blocks_ptr):
        pairs = tl.load(pairs_ptr + m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        rows = (pairs // PAIRS_PER_ROW).to(tl.int64)
        expert = tl.load(block_experts_ptr + m).to(tl.int64)
        n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = n < N
        a_rows = a_ptr + rows[:, None] * stride_a
        w_cols = w_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_inside = k < K
            a = tl.load(a_rows + k[None, :], mask=valid[:, None] & k_inside[None, :], other=0.0)
            w = tl.load(w_cols + k[:, None], mask=k_inside[:, None] & inside[None, :], other=0.0)
            acc = _dot(a, w, acc, PRECISION, UPCAST)
        if WEIGHTED:
            acc *= tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
        out = out_ptr + pairs[:, None].to(tl.int64) * stride_out + n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & inside[None, :])


def _expert_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    blocks: ExpertBlocks,
    weights: torch.Tensor | None,
    pairs_per_row: int,
    tiles: _Tiles,
) -> None:
    num_pairs, n = out.shape
    k = a.shape[1]
    precision = "ieee" if a.dtype == torch.float32 else "tf32"  # fp32 models: exact products
    upcast = a.device.type == "cpu" and a.dtype != torch.float32  # the interpreter
    grid = (blocks.max_blocks, triton.cdiv(n, tiles.block_n))
    _expert_gemm_kernel[grid](
        a, w, out, blocks.pairs, blocks.block_experts, blocks.num_blocks,
        weights if weights is not None else out, num_pairs, n, k, a.stride(0), w.stride(0),
        w.stride(1), out.stride(0),
        PAIRS_PER_ROW=pairs_per_row, WEIGHTED=weights is not None, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, PRECISION=precision, UPCAST=upcast,
        num_warps=tiles.num_warps,
    )  # fmt: skip


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    dependent_launch: bool = False,
) -> torch.Tensor:
    """x [T, H] (rows contiguous), w13 [E, 2I, H] and w2 [E, H, I] contiguous in x's dtype,
    topk_weights [T, k] float32 and topk_ids [T, k] int -> y [T, H] in x's dtype (module doc).
    dependent_launch: the activation between the GEMMs as the decode path's other Triton ops
    launch it."""
    t, hidden = x.shape
    num_experts, two_i, h_w13 = w13.shape
    inter = two_i // 2
    if h_w13 != hidden or two_i % 2 or w2.shape != (num_experts, hidden, inter):
        raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit x {hidden}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
        raise ValueError(f"topk ids {tuple(topk_ids.shape)}, weights {tuple(topk_weights.shape)}")
    if x.stride(1) != 1 or not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("x needs a unit column stride, w13 and w2 must be contiguous")
    if w13.dtype != x.dtype or w2.dtype != x.dtype or topk_weights.dtype != torch.float32:
        raise ValueError("x, w13 and w2 share a dtype; topk_weights are float32")
    top_k = topk_ids.shape[1]
    num_pairs = t * top_k
    if num_pairs == 0:
        return torch.zeros(t, hidden, dtype=x.dtype, device=x.device)
    tiles = _SMALL_TILES if num_pairs <= _SMALL_STEP else _LARGE_TILES
    blocks = align_by_expert(topk_ids, num_experts, tiles.block_m)
    gate_up = torch.empty(num_pairs, two_i, dtype=x.dtype, device=x.device)
    _expert_gemm(x, w13, gate_up, blocks, None, top_k, tiles)
    activated = silu_and_mul(gate_up, dependent_launch=dependent_launch)
    contributions = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    _expert_gemm(activated, w2, contributions, blocks, topk_weights.reshape(-1), 1, tiles)
    return contributions.view(t, top_k, hidden).sum(1).to(x.dtype)
