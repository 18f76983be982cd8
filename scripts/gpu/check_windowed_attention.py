"""The Triton paged attention's sliding window and logit softcap on the GPU: every option set
against the torch reference (kernels.attention_ref, float32 caches) on decode, chunked-prefill
and mixed steps, then what a window saves at long contexts (CUDA-graph timing, Llama-3.1-8B's
heads, bf16). One markdown report:

    python scripts/gpu/check_windowed_attention.py --out FILE
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pagedserve.kernels import attention_ref, triton_attention  # noqa: E402
from pagedserve.kernels.attention_metadata import (  # noqa: E402
    AttentionMetadata,
    build_attention_metadata,
)

BLOCK_SIZE = 16
# heads: Llama-3.1-8B's; the checks at head_dim 64 (fp32 prefill tiles of 128 dims do not fit
# the shared memory), the timing at 128
HEADS, KV_HEADS = 32, 8
DEVICE = torch.device("cuda")
CASES = {  # (cached tokens, new tokens) per request
    "decode": [(c, 1) for c in (0, 5, 17, 300, 1000, 4000)],
    "chunked prefill": [(0, 300), (700, 200), (2000, 64)],
    "mixed": [(0, 7), (40, 1), (333, 20), (5000, 1), (17, 160), (64, 1)],
}
OPTIONS = [(0, 0.0), (1, 0.0), (8, 0.0), (100, 0.0), (1000, 0.0), (0, 50.0), (8, 5.0), (1000, 50.0)]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def make_step(cases: list[tuple[int, int]], dtype: torch.dtype, seed: int, head_dim: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    blocks = [math.ceil((ctx + new) / BLOCK_SIZE) for ctx, new in cases]
    num_blocks = sum(blocks) + 1
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(cases), max(blocks), dtype=torch.int32)
    slots = []
    for r, ((ctx, new), n) in enumerate(zip(cases, blocks)):
        tables[r, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int32)
        pos = torch.arange(ctx, ctx + new)
        slots.append(tables[r, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    num_tokens = sum(new for _, new in cases)
    q = torch.randn(num_tokens, HEADS, head_dim, generator=gen).to(DEVICE, dtype)
    metadata = build_attention_metadata(
        torch.tensor([new for _, new in cases]), torch.tensor([c + n for c, n in cases]),
        tables, torch.cat(slots), BLOCK_SIZE, DEVICE,
    )  # fmt: skip
    return {"q": q, "k": k_cache, "v": v_cache, "metadata": metadata}


def triton_call(step: dict, window: int, softcap: float) -> torch.Tensor:
    return triton_attention.paged_attention_backend(
        step["q"], step["k"], step["v"], step["metadata"], step["q"].shape[-1] ** -0.5,
        window=window, softcap=softcap,
    )  # fmt: skip


def check() -> list[str]:
    lines = [
        "| step | dtype | (window, softcap): max abs error vs the reference |",
        "|---|---|---|",
    ]
    failures = 0
    for name, cases in CASES.items():
        for dtype in (torch.float32, torch.bfloat16):
            step = make_step(cases, dtype, seed=len(name), head_dim=64)
            metadata: AttentionMetadata = step["metadata"]
            cells = []
            for window, softcap in OPTIONS:
                got = triton_call(step, window, softcap).float()
                want = attention_ref.paged_attention(
                    step["q"].float(), step["k"].float(), step["v"].float(), metadata,
                    64**-0.5, window=window, softcap=softcap,
                )  # fmt: skip
                error = float((got - want).abs().max())
                ok = error <= TOLERANCE[dtype] and bool(torch.isfinite(got).all())
                failures += not ok
                cells.append(f"({window}, {softcap:g}) {error:.1e}{'' if ok else ' **FAIL**'}")
            lines.append(f"| {name} | {str(dtype)[6:]} | {'; '.join(cells)} |")
    lines.append(f"\n{failures} failed")
    return lines


def graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 100)  # µs a call
    return sorted(times)[2]


def timing() -> list[str]:
    lines = ["| step | window | softcap | µs | vs no window |", "|---|---:|---:|---:|---:|"]
    steps = {
        "decode 64 x 8k": [(8191, 1)] * 64,
        "prefill 1 x 8k": [(0, 8192)],
        "prefill 8k chunk after 24k": [(24576, 8192)],
    }
    for name, cases in steps.items():
        step = make_step(cases, torch.bfloat16, seed=1, head_dim=128)
        base = None
        for window, softcap in ((0, 0.0), (0, 50.0), (4096, 0.0), (1024, 0.0), (1024, 50.0)):
            us = graph_us(lambda s=step, w=window, c=softcap: triton_call(s, w, c))
            base = base or us
            lines.append(f"| {name} | {window} | {softcap:g} | {us:.1f} | {us / base:.2f} |")
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name()
    report = [f"# Windowed attention on {name}, {datetime.datetime.now():%Y-%m-%d %H:%M}\n"]
    report += ["## Against the reference\n", *check(), "\n## Timing (bf16, CUDA graphs)\n"]
    print("\n".join(report), flush=True)
    report += timing()
    Path(args.out).write_text("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
