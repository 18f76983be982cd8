"""The CUDA decode kernel's split count at small batches: for each shape, the planned split
count and the kernel's time with a range of forced counts (`decode(num_splits=...)`), next to
the Triton decode kernel on the same inputs. A shape's plan may be for a longer context than
its requests have (`plan` > context), as CUDA graphs plan for max_model_len. The planned run is
checked against the float32 torch reference, every forced count against the planned run.
Times are CUDA-graph replays with a cold L2 (bench_kernels.Timer).

    python scripts/gpu/sweep_decode_splits.py [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import (  # noqa: E402
    BLOCK_SIZE,
    MODELS,
    Timer,
    attention_metadata_cpu,
    build_attention_metadata,
    import_kernels,
    load_cuda_attention,
    triton_attention_fn,
)

# (batch, context, the max_seq_len the plan is made for)
SHAPES = [(1, 8192, 8192), (1, 4096, 4096), (1, 1024, 1024), (2, 4096, 4096), (4, 8192, 8192),
          (8, 4096, 4096), (16, 2048, 2048), (64, 2048, 2048),
          (1, 256, 4096), (1, 1024, 4096), (8, 512, 4096), (64, 1024, 4096)]  # fmt: skip
FORCED = [2, 4, 8, 16, 32, 64, 128]


def sweep_shape(
    kernels: tuple, cuda, model, batch: int, context: int, plan: int, timer: Timer
) -> str:  # type: ignore[no-untyped-def]
    attention, triton_attention, _, _ = kernels
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator().manual_seed(batch * 7 + context)
    meta = attention_metadata_cpu([(context - 1, 1)] * batch, gen)
    shape = (meta["num_blocks"], BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    k_cache = torch.randn(shape, device=device, dtype=dtype)
    v_cache = torch.randn(shape, device=device, dtype=dtype)
    q = torch.randn(batch, model.num_heads, model.head_dim, device=device, dtype=dtype)
    md = build_attention_metadata(
        meta["query_lens"], meta["seq_lens"], meta["block_tables"], meta["slot_mapping"],
        BLOCK_SIZE, device,
    )  # fmt: skip
    scale = model.head_dim**-0.5
    group = model.num_heads // model.num_kv_heads
    planned = cuda.planned_num_splits(batch, model.num_kv_heads, plan, model.head_dim, group, dtype)
    out = torch.empty_like(q)

    def run(splits: int | None) -> torch.Tensor:
        return cuda.decode(q, k_cache, v_cache, md.block_tables, md.seq_lens, scale, plan,
                           out=out, num_splits=splits)  # fmt: skip

    expected = run(None).clone()
    reference = attention.paged_attention(q.float(), k_cache.float(), v_cache.float(), md, scale)
    ref_error = (expected.float() - reference).abs().max().item()
    triton_fn = triton_attention_fn(triton_attention, q, k_cache, v_cache, md, scale)

    cells = [f"{timer.graph(lambda: run(None)):.1f} ({planned})"]
    best = (float("inf"), 0)
    for splits in FORCED:
        got = run(splits)
        error = (got.float() - expected.float()).abs().max().item()
        us = timer.graph(lambda s=splits: run(s))
        assert us is not None
        best = min(best, (us, splits))
        cells.append(f"{us:.1f}" + ("" if error < 2e-2 else f" ERR {error:.1e}"))
    triton_us = timer.graph(triton_fn)
    return (
        f"| {model.name} | {batch}x{context} | {plan} | {ref_error:.1e} | {triton_us:.1f} | "
        + " | ".join(cells)
        + f" | {best[1]} ({best[0]:.1f}) |"
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    kernels = import_kernels()
    cuda, reason = load_cuda_attention()
    if cuda is None:
        print(f"no CUDA kernel: {reason}")
        return 1
    timer = Timer(torch.device("cuda"))
    lines = [
        f"# CUDA decode kernel: split count sweep ({datetime.date.today()}, "
        f"{torch.cuda.get_device_name()})\n",
        "µs per call (CUDA graph, cold L2); `planned` is the kernel's own choice (its count).\n",
        "| model | batch x context | plan for | planned vs reference | Triton µs | planned | "
        + " | ".join(f"{s} splits" for s in FORCED)
        + " | best |",
        "|---|---|---:|---:|---:|---:|" + "---:|" * len(FORCED) + "---|",
    ]
    print("\n".join(lines), flush=True)
    for model in MODELS:
        for batch, context, plan in SHAPES:
            lines.append(sweep_shape(kernels, cuda, model, batch, context, plan, timer))
            print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
