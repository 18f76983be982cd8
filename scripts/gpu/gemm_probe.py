"""The decode GEMMs of a large batch (issue 15's W1 / W2): F.linear through cuBLAS, cuBLASLt,
and a plain Triton tiled GEMM, on the projection shapes of Qwen3-0.6B and Llama-3.1-8B.

W1's step at 198 running requests (Qwen3-0.6B, scripts/results/session21_h200.md) spent ~800 µs
in its 112 projection GEMMs, ~3x their weight-read and flop floors: small GEMMs (K = 1024-3072)
whose tiles leave SMs idle. Each variant runs the model's sequence of projections (every layer's
four, distinct weights so nothing stays in L2) captured in one CUDA graph; the table gives µs
per layer, and TFLOP/s and weight GB/s of the whole sequence. Outputs are checked against
F.linear in float32 first.

    python scripts/gpu/gemm_probe.py [--rows 64 128 200 256 1024] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MODELS = {  # layers, (name, N, K) of each projection
    "qwen3-0.6b": (28, [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024),
                        ("down", 1024, 3072)]),
    "llama-3.1-8b": (32, [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                          ("down", 4096, 14336)]),
}  # fmt: skip
TRITON_CONFIGS = [  # BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages
    (64, 64, 64, 1, 4, 4),
    (64, 128, 64, 1, 4, 4),
    (128, 64, 64, 1, 4, 4),
    (128, 128, 64, 1, 8, 3),
    (64, 64, 128, 1, 4, 3),
    (64, 64, 64, 2, 4, 4),
    (64, 128, 64, 2, 4, 4),
    (128, 128, 64, 2, 8, 3),
    (64, 64, 64, 4, 4, 4),
]


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):  # fmt: skip
    """out[m, n] (+)= sum_k x[m, k] w[n, k] over split pid_k's K range: fp32 accumulation,
    stored in out's dtype (SPLIT_K 1) or atomically added to a zeroed fp32 out."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_per = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    rk = pid_k * k_per + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tl.minimum(rm, M - 1)[:, None] * K + rk[None, :]
    w_ptrs = w_ptr + tl.minimum(rn, N - 1)[:, None] * K + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, k_per, BLOCK_K):
        acc = tl.dot(tl.load(x_ptrs), tl.trans(tl.load(w_ptrs)), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    ptrs = out_ptr + rm[:, None] * N + rn[None, :]
    if SPLIT_K == 1:
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")


def triton_linear(config: tuple[int, ...]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    bm, bn, bk, split, warps, stages = config

    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        n = w.shape[0]
        assert k % (bk * split) == 0
        if split == 1:
            out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        else:
            out = torch.zeros((m, n), dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
        _gemm_kernel[grid](x, w, out, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                           SPLIT_K=split, num_warps=warps, num_stages=stages)  # fmt: skip
        return out if split == 1 else out.to(x.dtype)

    return linear


def graph_us(fn: Callable[[], None], reps: int = 10) -> float:
    """µs of one fn() replayed from a CUDA graph (median of reps, 3 replays each)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compile / autotune outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / 3)
    return sorted(times)[len(times) // 2]


Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def measure(linear: Linear, weights: list[list[torch.Tensor]],
            xs: list[torch.Tensor]) -> tuple[float, list[float], float]:  # fmt: skip
    """Max relative error of layer 0's products against float32, µs a layer of each
    projection over every layer, and µs of the whole sequence."""
    errs = []
    for x, w in zip(xs, weights[0]):
        ref = F.linear(x.float(), w.float())
        errs.append(((linear(x, w).float() - ref).abs().max() / ref.abs().max()).item())

    def one(i: int) -> Callable[[], None]:
        def run() -> None:
            for layer in weights:
                linear(xs[i], layer[i])

        return run

    def every() -> None:
        for layer in weights:
            for x, w in zip(xs, layer):
                linear(x, w)

    per_shape = [graph_us(one(i)) / len(weights) for i in range(len(xs))]
    return max(errs), per_shape, graph_us(every)


def model_rows(model: str, rows_list: list[int], gen: torch.Generator) -> list[str]:
    layers, shapes = MODELS[model]
    weights = [[torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
                for _, n, k in shapes] for _ in range(layers)]  # fmt: skip
    weight_bytes = sum(w.numel() * 2 for layer in weights for w in layer)
    variants: dict[str, Linear] = {"cublas F.linear": F.linear, "cublaslt F.linear": F.linear}
    for config in TRITON_CONFIGS:
        variants["triton " + "x".join(map(str, config))] = triton_linear(config)
    lines = []
    for rows in rows_list:
        xs = [torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
              for _, _, k in shapes]  # fmt: skip
        flops = 2 * rows * sum(n * k for _, n, k in shapes) * layers
        names = " | ".join(f"{name} µs" for name, _, _ in shapes)
        lines += [f"## {model}, {rows} rows ({layers} layers)", "",
                  f"| variant | max rel err | µs a layer | {names} | TFLOP/s | weight GB/s |",
                  "|---|---:|---:|" + "---:|" * len(shapes) + "---:|---:|"]  # fmt: skip
        for name, linear in variants.items():
            lt = name.startswith("cublaslt")
            torch.backends.cuda.preferred_blas_library("cublaslt" if lt else "cublas")
            err, per_shape, total = measure(linear, weights, xs)
            each = " | ".join(f"{t:.1f}" for t in per_shape)
            rates = f"{flops / total / 1e6:.0f} | {weight_bytes / total / 1e3:.0f}"
            lines.append(f"| {name} | {err:.1e} | {total / layers:.1f} | {each} | {rates} |")
            print(lines[-1], flush=True)
        torch.backends.cuda.preferred_blas_library("cublas")
        lines.append("")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128, 200, 256, 1024])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lines = [f"# Decode GEMMs of large batches (`python scripts/gpu/gemm_probe.py "
             f"{' '.join(sys.argv[1:])}`)", ""]  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(0)
    for model in args.models:
        lines += model_rows(model, args.rows, gen)
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
