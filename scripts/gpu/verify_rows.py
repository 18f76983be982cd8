"""What a speculative verify of a few rows costs against a one-row decode step (issue 12),
with the linear layers' products of up to R rows on the Triton weight-streaming GEMM
(EngineConfig.small_batch_gemm_rows = R) against cuBLAS past one row (R = 1, the default).

1. Per projection of the `target` preset (20 x 640, the speculative benchmarks' target) and of
   Qwen3-0.6B: µs per call of triton_gemv.skinny_linear and of F.linear (cuBLAS) at 1, 2, 4,
   8, 9 and 16 rows (CUDA graphs of cold-L2 calls, bench_kernels.Timer), each checked
   against the fp32 reference.
2. Per R in --max-rows: a ModelRunner of the target (dummy weights, bf16, decode graphs at
   1, 2, 4, 8, 16 rows): µs per replay of each decode graph (CUDA events over 200 replays),
   and each graph's logits against R = 1's on the same inputs (max |diff|, argmax agreement).

    python scripts/gpu/verify_rows.py [--max-rows 1 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_kernels import MODELS, Timer, projection_shapes  # noqa: E402
from spec_anatomy import git_revision, target_dir  # noqa: E402

from pagedserve.actors.worker import startup  # noqa: E402
from pagedserve.actors.worker.model_runner import ModelRunner  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.kernels import triton_gemv  # noqa: E402

ROWS = (1, 2, 4, 8, 9, 16)
TARGET_SHAPES = [("qkv", 1280, 640), ("o_proj", 640, 640), ("gate_up", 3456, 640),
                 ("down", 640, 1728), ("lm_head", 4096, 640)]  # fmt: skip


def gemm_table(timer: Timer) -> list[str]:
    qwen = next(m for m in MODELS if "qwen" in m.name.lower())
    shapes = [("target " + n, out, k) for n, out, k in TARGET_SHAPES]
    shapes += [(f"{qwen.name} {n}", out, k) for n, out, k in projection_shapes(qwen)]
    lines = ["| projection (N x K) | rows | Triton µs | cuBLAS µs | Triton / cuBLAS "
             "| max rel. err |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, n, k in shapes:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = triton_gemv.reference(x, w).float()
            got = triton_gemv.skinny_linear(x, w).float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            ours = timer.graph(lambda: triton_gemv.skinny_linear(x, w))  # noqa: B023
            cublas = timer.graph(lambda: F.linear(x, w))  # noqa: B023
            ratio = ours / cublas if ours and cublas else float("nan")
            lines.append(f"| {name} {n}x{k} | {m} | {ours:.1f} | {cublas:.1f} | {ratio:.2f} | "
                         f"{err:.1e} |")  # fmt: skip
            print(lines[-1], flush=True)
    return lines


def runner_for(model_dir: Path, rows: int) -> ModelRunner:
    blocks = 16 * 64
    config = EngineConfig(
        model=str(model_dir), load_format="dummy", device="cuda", dtype="bfloat16",
        max_model_len=1024, max_num_seqs=16, num_kv_blocks=blocks, skip_tokenizer_init=True,
        small_batch_gemm_rows=rows,
    ).resolve()  # fmt: skip
    runner = ModelRunner(config)
    runner.load_model()
    startup.compile_kernels_ahead(runner)
    startup.init_kv_cache(runner, blocks)  # and the decode graphs
    return runner


def replay_us(graph: torch.cuda.CUDAGraph, reps: int = 200) -> float:
    for _ in range(20):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def graph_table(model_dir: Path, max_rows: list[int]) -> list[str]:
    lines = ["| R (rows on the Triton GEMM) | graph rows | µs per replay | vs 1 row "
             "| max abs logit diff vs R=1 | argmax equal |",
             "|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    first: dict[int, torch.Tensor] = {}
    for rows in max_rows:
        runner = runner_for(model_dir, rows)
        step = runner.decode_step
        assert step is not None and step.graphs, "no decode graphs"
        one = None
        for size in sorted(step.graphs):
            graph, logits = step.graphs[size]
            us = replay_us(graph)
            one = one or us
            graph.replay()
            torch.cuda.synchronize()
            out = logits.float().clone()
            base = first.setdefault(size, out)
            diff = (out - base).abs().max().item()
            same = bool((out.argmax(-1) == base.argmax(-1)).all())
            lines.append(f"| {rows} | {size} | {us:.1f} | {us / one:.2f} | {diff:.3g} | {same} |")
            print(lines[-1], flush=True)
        runner.close()
        del runner
        torch.cuda.empty_cache()
    return lines


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model_dir = target_dir(Path(tempfile.mkdtemp(prefix="target_94m_")))
    lines = [
        f"# Verify rows ({datetime.datetime.now():%Y-%m-%d %H:%M}, "
        f"{torch.cuda.get_device_name()}), at {git_revision()}\n",
        f"command: `python scripts/gpu/verify_rows.py {' '.join(sys.argv[1:])}`\n",
        "## Per projection (bf16, cold L2, CUDA graphs)\n",
        *gemm_table(Timer(torch.device("cuda"))),
        "\n## Decode graphs of the target (dummy weights), by R\n",
        *graph_table(model_dir, args.max_rows),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
