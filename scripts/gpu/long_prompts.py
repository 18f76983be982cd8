"""Where the 32 x 7-8k-token workload's time goes (issue 15), and what its parts could cost.

1. The workload (Llama-3.1-8B dummy bf16, 32 prompts U[7000, 8000], 64 output tokens, as
   bench_first_token.py's `long`) with the worker's step log (device seconds by step kind) and
   a torch.profiler window over four prefill steps (device time per step by kernel).
2. Attention of the prefill alone, Llama heads (32 q / 8 kv, head_dim 128, bf16, block size
   16), each variant checked against the float32 reference first: this engine's Triton kernel,
   FlashInfer's paged prefill (its first call's JIT compile timed), and torch's SDPA backends
   (cuDNN, flash, memory-efficient) per request, over K/V gathered from the paged cache and
   over contiguous K/V (what a path that keeps the projection's K/V would read).
3. The prefill GEMMs of one Llama layer at 8,192 rows (cuBLAS through F.linear).
The summary table is printed last.

    PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu/long_prompts.py [--skip-workload]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts" / "gpu")]

from sweep_prefill import BLOCK_SIZE, HEAD_DIM, Step, flashinfer_fn, make_step, triton_fn  # noqa: E402

from pagedserve.api import bench  # noqa: E402
from pagedserve.config import ProfileConfig  # noqa: E402
from pagedserve.kernels import attention_ref  # noqa: E402

LLAMA = str(ROOT / "scripts" / "gpu" / "configs" / "llama-3.1-8b")
SUMMARY: list[str] = []


def workload() -> None:
    directory = Path(tempfile.mkdtemp(prefix="long-profile-"))
    requests = bench.random_workload(32, (7000, 8000), (64, 64), 1000, seed=5)
    window = ProfileConfig(output_dir=str(directory), first_step=3, num_steps=4)
    args = dict(model=LLAMA, load_format="dummy", skip_tokenizer_init=True, max_model_len=8192,
                device="cuda", profile=window)  # fmt: skip
    result = bench.run_pagedserve(requests, args)
    SUMMARY.append(f"| workload (step log on) | {result.elapsed_s:.2f} s | |")
    steps = json.loads((directory / "worker0.steps.json").read_text())
    for kind, t in steps["by_kind"].items():
        SUMMARY.append(f"| {kind} steps: {t['steps']}, {t['tokens']} tokens | "
                       f"device {t['device_s']:.2f} s | host {t['host_s']:.2f} s |")  # fmt: skip
    print("\n".join(SUMMARY), flush=True)
    print("| kernel (prefill steps 3-6) | launches / step | µs / step |\n|---|---:|---:|")
    for row in json.loads((directory / "worker0.kernels.json").read_text())[:25]:
        print(f"| {row['name'][:100]} | {row['per_step']:.1f} | {row['us_per_step']:.1f} |")


def gathered(step: Step, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Request b's q [1, H, q, d] and its K, V [1, Hkv, ctx, d] gathered from the paged cache."""
    md = step.metadata
    start, end = int(md.query_start_loc[b]), int(md.query_start_loc[b + 1])
    ctx = int(md.seq_lens_cpu[b])
    blocks = md.block_tables[b, : triton.cdiv(ctx, BLOCK_SIZE)]
    k = step.k_cache[blocks].flatten(0, 1)[:ctx]
    v = step.v_cache[blocks].flatten(0, 1)[:ctx]
    return step.q[start:end].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]


def sdpa_fn(step: Step, backend: SDPBackend, gather: bool) -> Callable[[], torch.Tensor]:
    """Per request SDPA, causal (fresh prompts: q_len == ctx), GQA by expanding K/V."""
    batch = len(step.metadata.seq_lens_cpu)
    groups = step.q.shape[1] // step.k_cache.shape[2]
    kept = [gathered(step, b) for b in range(batch)]
    kept = [(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)) for q, k, v in kept]
    out = torch.empty_like(step.q)
    starts = step.metadata.query_start_loc.tolist()

    def run() -> torch.Tensor:
        with sdpa_kernel(backend):
            for b in range(batch):
                if gather:
                    q, k, v = gathered(step, b)
                    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
                else:
                    q, k, v = kept[b]
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                out[starts[b] : starts[b + 1]] = o[0].transpose(0, 1)
        return out

    return run


def attention() -> None:
    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001 - measure without it
        print(f"flashinfer unavailable: {exc}")
        flashinfer = None
    check = make_step([(0, 1000), (0, 300), (0, 77)], 32, 8, seed=1)
    expected = attention_ref.paged_attention(
        check.q.float(), check.k_cache.float(), check.v_cache.float(), check.metadata,
        HEAD_DIM**-0.5,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    long = [(0, int(n)) for n in torch.randint(7000, 8001, (32,), generator=gen)]
    step = make_step(long, 32, 8, seed=2)
    variants: dict[str, Callable[[Step], Callable[[], torch.Tensor]]] = {
        "triton": lambda s: triton_fn(s, None, True)  # the engine's own tiles
    }
    if flashinfer is not None:
        variants["flashinfer"] = lambda s: flashinfer_fn(s, flashinfer)
    for name, backend in [("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:  # fmt: skip
        variants[f"sdpa {name} gathered"] = lambda s, b=backend: sdpa_fn(s, b, True)
        variants[f"sdpa {name} contiguous"] = lambda s, b=backend: sdpa_fn(s, b, False)
    for name, make in variants.items():
        try:
            first = time.perf_counter()
            error = (make(check)().float() - expected).abs().max().item()
            first = time.perf_counter() - first
            ms = triton.testing.do_bench(make(step), warmup=3, rep=30, return_mode="median")
            tflops = step.flops / ms / 1e9
            SUMMARY.append(f"| attention 32x7-8k: {name} | {tflops:.0f} TFLOP/s, {ms:.1f} ms "
                           f"a layer | err {error:.1e}, first call {first:.1f} s |")  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - report, continue
            traceback.print_exc()
            SUMMARY.append(f"| attention: {name} | FAIL {type(exc).__name__}: {str(exc)[:80]} | |")
        print(SUMMARY[-1], flush=True)


def gemms() -> None:
    shapes = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
              "down": (4096, 14336)}  # fmt: skip
    total_ms, total_flops = 0.0, 0.0
    for name, (n, k) in shapes.items():
        x = torch.randn(8192, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        ms = triton.testing.do_bench(
            lambda x=x, w=w: F.linear(x, w), warmup=5, rep=50, return_mode="median"
        )
        flops = 2 * 8192 * n * k
        total_ms, total_flops = total_ms + ms, total_flops + flops
        SUMMARY.append(f"| GEMM {name} 8192x{n}x{k} | {flops / ms / 1e9:.0f} TFLOP/s "
                       f"| {ms * 1e3:.0f} µs |")  # fmt: skip
    workload_s = total_ms * 32 * 240_000 / 8192 / 1e3
    SUMMARY.append(f"| GEMMs of a layer at 8192 rows | {total_flops / total_ms / 1e9:.0f} "
                   f"TFLOP/s | x 32 layers x 240k/8192 chunks: {workload_s:.2f} s |")  # fmt: skip
    print("\n".join(SUMMARY[-5:]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-workload", action="store_true")
    args = parser.parse_args()
    if not args.skip_workload:
        workload()
    gemms()
    attention()
    print("\n| part | figure | note |\n|---|---:|---|\n" + "\n".join(SUMMARY))


if __name__ == "__main__":
    main()
