"""Where a speculative verify's time goes on the device, kernel by kernel (issue 12).

A ModelRunner with the `target` preset's Llama (dummy weights, the benchmark's shape), batch 1,
n-gram k drafts (always k: SpecSession pads them), stepped as the scheduler steps it. For each
variant (rows of the Triton weight-streaming GEMM, rounds a step): the synced time of a plain
decode step and of a speculative step, then a torch.profiler trace of each kind of step: the
device's busy time and window per step, its largest idle gaps, and the kernels by device time.

    python scripts/gpu/verify_trace.py [--k 8] [--gemm-rows 1 16] [--rounds 1 8] [--device-rounds]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))

import torch  # noqa: E402
from spec_anatomy import SpecSession, git_revision, sync, target_dir  # noqa: E402

from pagedserve.actors.worker import startup, verify_step  # noqa: E402
from pagedserve.actors.worker.model_runner import ModelRunner  # noqa: E402
from pagedserve.actors.worker.profiling import idle_summary, kernel_table  # noqa: E402
from pagedserve.config import EngineConfig, SpeculativeConfig  # noqa: E402

CONTEXT = 200
BLOCKS = 128
ROOM = 600  # tokens a request may add (SpecSession holds 700 past its context)
T = TypeVar("T")


def make_runner(
    target: Path, k: int, rounds: int, gemm_rows: int, on_device: bool, device: str
) -> ModelRunner:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=4,
                             prompt_lookup_min=2, num_rounds=rounds,
                             rounds_on_device=on_device)  # fmt: skip
    config = EngineConfig(
        model=str(target), load_format="dummy", device=device, dtype="bfloat16",
        max_model_len=1024, max_num_seqs=1, num_kv_blocks=BLOCKS, skip_tokenizer_init=True,
        speculative_config=spec, small_batch_gemm_rows=gemm_rows,
    ).resolve()  # fmt: skip
    runner = ModelRunner(config)
    runner.load_model()
    startup.compile_kernels_ahead(runner)
    startup.init_kv_cache(runner, BLOCKS)
    return runner


def timed_steps(session: SpecSession, speculate: bool, iters: int) -> tuple[float, float]:
    """Median ms of a step run to completion and the mean tokens it emitted."""
    times, emitted = [], []
    for _ in range(iters):
        sync(session.runner.device)
        start = time.perf_counter()
        result = session.step(speculate)
        sync(session.runner.device)
        times.append(time.perf_counter() - start)
        emitted.append(sum(result.num_sampled or [1]))
    return statistics.median(times) * 1e3, statistics.mean(emitted)


def traced(session: SpecSession, speculate: bool, steps: int) -> list[str]:
    """The device timeline of `steps` steps run back to back (a sync after each)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            session.step(speculate)
            sync(session.runner.device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    idle = idle_summary(intervals, steps)
    table = kernel_table([(e.name, e.time_range.elapsed_us()) for e in kernels], steps)
    lines = [
        f"- device window {idle.wall_per_step_us:.0f} µs a step, busy {idle.busy_per_step_us:.0f}"
        f" µs ({100 * (1 - idle.idle_fraction):.0f}%), kernels {len(kernels) / steps:.0f} a step,"
        f" gaps over 10 µs {idle.num_gaps_over_10us / steps:.1f} a step, largest"
        f" {idle.largest_gaps_us[:6]} µs",
        "",
        "| kernel | per step | µs a step |",
        "|---|---:|---:|",
    ]
    for row in table[:14]:
        lines.append(f"| `{row['name'][:70]}` | {row['per_step']:.1f} | "
                     f"{row['us_per_step']:.1f} |")  # fmt: skip
    return lines


def fresh(runner: ModelRunner, k: int) -> SpecSession:
    """A new request (its context computed) whose next step verifies k drafts."""
    session = SpecSession(runner, 1, CONTEXT, 0, k)
    for speculate in (False, True):
        session.step(speculate)
    return session


def phase(runner: ModelRunner, k: int, run: Callable[[SpecSession], T]) -> T:
    """run(session) on a fresh request, which then leaves the batch (its blocks are reused)."""
    session = fresh(runner, k)
    try:
        return run(session)
    finally:
        session.close()


def variant(
    target: Path, k: int, rounds: int, gemm_rows: int, on_device: bool, iters: int, device: str,
    run_ahead: bool = True,
) -> list[str]:  # fmt: skip
    # run_ahead off: the host's rounds without drafts each synced, as before d3298d5
    never = mock.patch.object(verify_step, "runs_ahead", lambda *args: False)
    with contextlib.nullcontext() if run_ahead else never:
        lines = measure(target, k, rounds, gemm_rows, on_device, iters, device)
    if not run_ahead:
        lines[0] = lines[0].replace("on the host", "on the host (rounds without drafts synced)")
    print("\n".join(lines), flush=True)
    return lines


def measure(
    target: Path, k: int, rounds: int, gemm_rows: int, on_device: bool, iters: int, device: str
) -> list[str]:
    runner = make_runner(target, k, rounds, gemm_rows, on_device, device)
    steps = max(2, min(iters, ROOM // (rounds * (1 + k))))  # within the request's blocks
    plain_ms, _ = phase(runner, k, lambda s: timed_steps(s, False, iters))
    spec_ms, emitted = phase(runner, k, lambda s: timed_steps(s, True, steps))
    where = "on the device" if on_device else "on the host"
    lines = [
        f"\n### n-gram k={k}, {rounds} round(s) a step {where}, Triton GEMM up to {gemm_rows} "
        "row(s)\n",
        f"- synced: plain step {plain_ms:.3f} ms; speculative step {spec_ms:.3f} ms "
        f"({spec_ms / rounds:.3f} a round), {emitted:.1f} tokens a step, "
        f"{spec_ms / max(emitted, 1e-9):.3f} ms a token",
        "\nplain decode steps:",
        *phase(runner, k, lambda s: traced(s, False, 10)),
        "\nspeculative steps:",
        *phase(runner, k, lambda s: traced(s, True, steps)),
    ]
    runner.close()
    if device == "cuda":
        torch.cuda.empty_cache()
    return lines


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else device


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--gemm-rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--device-rounds", action="store_true", help="also rounds_on_device")
    parser.add_argument(
        "--no-run-ahead", action="store_true",
        help="also host rounds whose rounds without drafts are each synced (not run ahead)",
    )  # fmt: skip
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    target = target_dir(Path(tempfile.mkdtemp(prefix="target_94m_")))
    lines = [
        f"# Verify trace ({device_name(args.device)}, {git_revision()})\n",
        f"command: `python scripts/gpu/verify_trace.py {' '.join(sys.argv[1:])}`; target "
        f"preset (dummy weights, bf16), batch 1, context {CONTEXT}, medians of {args.iters}",
    ]
    for gemm_rows in args.gemm_rows:
        for rounds in args.rounds:
            for on_device in (False, True) if rounds > 1 and args.device_rounds else (False,):
                lines += variant(target, args.k, rounds, gemm_rows, on_device, args.iters,
                                 args.device)  # fmt: skip
            if rounds > 1 and args.no_run_ahead:
                lines += variant(target, args.k, rounds, gemm_rows, False, args.iters,
                                 args.device, run_ahead=False)  # fmt: skip
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
