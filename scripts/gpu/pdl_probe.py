#!/usr/bin/env python3
"""Does programmatic dependent launch (PDL) shorten a batch-1 decode chain on this GPU?

A stand-alone probe (torch and triton only): the per-layer kernel chain of a batch-1 decode step
(RMSNorm, the four projections as single-row GEMVs, SiLU-and-mul; no attention), for the layers
of Llama-3.1-8B and Qwen3-0.6B, captured in one CUDA graph and replayed. Variants:
  plain     every kernel launched as usual (a kernel starts when its predecessor has ended)
  pdl       launched with PDL: each kernel waits (griddepcontrol.wait) at its top, then lets its
            dependent launch (griddepcontrol.launch_dependents)
  pdl+pre   as pdl, and each kernel first loads what no predecessor writes (its first weight
            chunk, the norm weight) before it waits
Every variant's output is compared with plain's bit for bit, then ms per replay (median of
rounds, variants interleaved) is printed as a table.

    python3 scripts/gpu/pdl_probe.py [--rounds 7] [--replays 50]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

SHAPES = {  # hidden, (qkv rows, o_proj K, gate_up rows, down K), layers
    "llama-3.1-8b": (4096, (6144, 4096, 28672, 14336), 32),
    "qwen3-0.6b": (1024, (4096, 2048, 6144, 3072), 28),
}


@triton.jit
def _gdc(USE_GDC: tl.constexpr):
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _norm_kernel(x_ptr, w_ptr, out_ptr, N: tl.constexpr, USE_GDC: tl.constexpr,
                 PREFETCH: tl.constexpr):  # fmt: skip
    """out = x / sqrt(mean(x^2) + 1e-5) * w over one row of N."""
    r = tl.arange(0, N)
    if PREFETCH:
        w = tl.load(w_ptr + r).to(tl.float32)
    _gdc(USE_GDC)
    if not PREFETCH:
        w = tl.load(w_ptr + r).to(tl.float32)
    x = tl.load(x_ptr + r).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + 1e-5)
    tl.store(out_ptr + r, (x * rstd * w).to(tl.bfloat16))


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, H, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    """out[i] = silu(x[i]) * x[H + i]."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _gdc(USE_GDC)
    g = tl.load(x_ptr + r).to(tl.float32)
    u = tl.load(x_ptr + H + r).to(tl.float32)
    tl.store(out_ptr + r, (g / (1.0 + tl.exp(-g)) * u).to(tl.bfloat16))


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 USE_GDC: tl.constexpr, PREFETCH: tl.constexpr):  # fmt: skip
    """out[n] = sum_k x[k] W[n, k] (fp32 sums) for this program's BLOCK_N rows."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :]
    if PREFETCH:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    _gdc(USE_GDC)
    if not PREFETCH:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    x = tl.load(x_ptr + rk)
    acc = x.to(tl.float32)[None, :] * w.to(tl.float32)
    for k in range(BLOCK_K, K, BLOCK_K):
        w = tl.load(w_ptrs + k, eviction_policy="evict_first")
        x = tl.load(x_ptr + k + rk)
        acc += x.to(tl.float32)[None, :] * w.to(tl.float32)
    tl.store(out_ptr + rn, tl.sum(acc, 1).to(tl.bfloat16))


class Chain:
    def __init__(self, model: str, device: torch.device) -> None:
        hidden, (qkv, o_k, gate_up, down_k), layers = SHAPES[model]
        g = torch.Generator(device=device).manual_seed(0)

        def rand(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=g, device=device) * 0.02).to(torch.bfloat16)

        self.hidden, self.layers = hidden, layers
        self.norm_w = [torch.ones(hidden, device=device, dtype=torch.bfloat16) for _ in range(2)]
        self.weights = [(rand(qkv, hidden), rand(hidden, o_k), rand(gate_up, hidden),
                         rand(hidden, down_k)) for _ in range(layers)]  # fmt: skip
        self.x = torch.randn(hidden, generator=g, device=device).to(torch.bfloat16)
        self.buf = {n: torch.empty(n, device=device, dtype=torch.bfloat16)
                    for n in {hidden, qkv, o_k, gate_up, down_k}}  # fmt: skip
        self.normed = torch.empty(hidden, device=device, dtype=torch.bfloat16)
        self.h = torch.empty(hidden, device=device, dtype=torch.bfloat16)

    def gemv(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, pdl: bool, pre: bool):
        n, k = w.shape
        block_k = min(1024, k)
        _gemv_kernel[(n // 4,)](x, w, out, k, BLOCK_N=4, BLOCK_K=block_k, USE_GDC=pdl,
                                PREFETCH=pre, num_warps=4, launch_pdl=pdl)  # fmt: skip

    def forward(self, pdl: bool, pre: bool) -> torch.Tensor:
        hidden = self.hidden
        x = self.x
        for qkv_w, o_w, gu_w, down_w in self.weights:
            _norm_kernel[(1,)](x, self.norm_w[0], self.normed, N=hidden, USE_GDC=pdl,
                               PREFETCH=pre, num_warps=4, launch_pdl=pdl)  # fmt: skip
            qkv = self.buf[qkv_w.shape[0]]
            self.gemv(self.normed, qkv_w, qkv, pdl, pre)
            self.gemv(qkv[: o_w.shape[1]], o_w, self.h, pdl, pre)  # attention's stand-in
            _norm_kernel[(1,)](self.h, self.norm_w[1], self.normed, N=hidden, USE_GDC=pdl,
                               PREFETCH=pre, num_warps=4, launch_pdl=pdl)  # fmt: skip
            gu = self.buf[gu_w.shape[0]]
            self.gemv(self.normed, gu_w, gu, pdl, pre)
            act = self.buf[down_w.shape[1]]
            half = down_w.shape[1]
            _silu_mul_kernel[(half // 1024,)](gu, act, half, BLOCK=1024, USE_GDC=pdl,
                                              num_warps=4, launch_pdl=pdl)  # fmt: skip
            self.gemv(act, down_w, self.buf[hidden], pdl, pre)
            x = self.buf[hidden]
        return x.clone()


def graph_of(chain: Chain, pdl: bool, pre: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    for _ in range(2):
        chain.forward(pdl, pre)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain.forward(pdl, pre)
    return graph, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--replays", type=int, default=50)
    args = parser.parse_args()
    device = torch.device("cuda")
    variants = {"plain": (False, False), "pdl": (True, False), "pdl+pre": (True, True)}
    rows = []
    for model in SHAPES:
        chain = Chain(model, device)
        graphs = {name: graph_of(chain, *flags) for name, flags in variants.items()}
        for graph, _ in graphs.values():
            graph.replay()
        torch.cuda.synchronize()
        reference = graphs["plain"][1]
        same = {name: bool(torch.equal(out, reference)) for name, (_, out) in graphs.items()}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, (graph, _) in graphs.items():
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.replays):
                    graph.replay()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / args.replays)
        plain = statistics.median(times["plain"])
        for name in variants:
            ms = statistics.median(times[name])
            rows.append(f"| {model} | {name} | {ms:.4f} | {plain / ms:.3f} | {same[name]} |")
        del graphs, chain
        torch.cuda.empty_cache()
    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name()}")  # fmt: skip
    print("| model | variant | ms per replay | speed-up vs plain | output == plain |")
    print("|---|---|---:|---:|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
