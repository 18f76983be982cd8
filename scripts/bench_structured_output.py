"""CPU throughput of constrained decoding: the same workload with and without JSON schemas.
Writes a markdown table to scripts/results/structured_output.md.

Workload: N requests, each a short prompt and one of 20 seeded random schemas
(tests/json_schemas.py: nested objects, enums, arrays, numbers), sampled at temperature 1 with
a seed per request. The constrained run decides each request's output length (its JSON ends it);
the unconstrained run asks for exactly those lengths (EOS ignored), same prompts and sampling,
so both runs produce the same tokens' worth of work. The constrained workload runs first with
the worker's grammar cache cold (every schema compiles during the run), then warm, alternating
with the unconstrained one. Timing starts once the engine's processes are idle.

    python scripts/bench_structured_output.py [--requests 64] [--repeats 5]
    python scripts/bench_structured_output.py --device cuda --out FILE   # (scripts/gpu/run.sh)
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedserve import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from tests.json_schemas import random_schema  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "structured_output.md"
PROMPTS = ["ROMEO:", "JULIET:", "First Citizen:", "HAMLET:", "KING LEAR:", "MACBETH:"]


def wait_until_idle(limit_s: float = 120.0) -> None:
    """Until the engine's processes are idle (the supervisor's standby actors import their
    modules for several seconds after start; timing that would measure them)."""
    children = psutil.Process().children(recursive=True)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = sum(sum(p.cpu_times()[:2]) for p in children if p.is_running())
        time.sleep(1.0)
        if sum(sum(p.cpu_times()[:2]) for p in children if p.is_running()) - before < 0.05:
            return


def timed_run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    schemas = [random_schema(rng) for _ in range(20)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    constrained = [
        SamplingParams(
            temperature=1.0, seed=args.seed + i, max_tokens=400,
            structured_outputs=StructuredOutputsParams(json=schemas[i % len(schemas)]),
        )
        for i in range(args.requests)
    ]  # fmt: skip
    rows = []
    with LLM(max_num_seqs=args.requests, device=args.device) as llm:
        llm.generate(prompts[:1], SamplingParams(max_tokens=8), use_tqdm=False)  # warm up
        wait_until_idle()
        cold, outputs = timed_run(llm, prompts, constrained)
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        assert all(o.outputs[0].finish_reason == "stop" for o in outputs), "a JSON did not end"
        plain = [
            SamplingParams(temperature=1.0, seed=args.seed + i, max_tokens=n, ignore_eos=True)
            for i, n in enumerate(lengths)
        ]
        for _ in range(args.repeats):
            with_schema, outputs = timed_run(llm, prompts, constrained)
            without, plain_outputs = timed_run(llm, prompts, plain)
            assert [len(o.outputs[0].token_ids) for o in plain_outputs] == lengths
            rows.append((with_schema, without))
    write_results(args, sum(lengths), cold, rows)


def write_results(
    args: argparse.Namespace, tokens: int, cold: float, rows: list[tuple[float, float]]
) -> None:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    machine = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"{platform.machine()}, {torch.get_num_threads()} torch threads"
    )
    lines = [
        f"# Constrained decoding (JSON schemas), {args.device}: throughput with and without\n",
        f"- date: {datetime.date.today()}",
        f"- machine: {machine}, torch {torch.__version__}; load average at the end "
        f"{os.getloadavg()[0]:.1f} (1 min), {os.getloadavg()[1]:.1f} (5 min), from every process",
        f"- commit: {commit}",
        "- model: pagedserve/tiny-shakespeare (the embedded model)",
        f"- workload: {args.requests} requests, 20 random schemas (tests/json_schemas.py, "
        f"seed {args.seed}), temperature 1, {tokens} output tokens per run",
        f"- command: `python scripts/bench_structured_output.py {' '.join(sys.argv[1:])}`\n",
        "| run | with schemas s | without s | output tok/s with | output tok/s without "
        "| with / without |",
        "|---|---:|---:|---:|---:|---:|",
        f"| grammar cache cold | {cold:.2f} | - | {tokens / cold:.1f} | - | - |",
    ]
    for i, (with_schema, without) in enumerate(rows, 1):
        lines.append(
            f"| warm {i} | {with_schema:.2f} | {without:.2f} | {tokens / with_schema:.1f} "
            f"| {tokens / without:.1f} | **{without / with_schema:.0%}** |"
        )
    ratios = sorted(without / with_schema for with_schema, without in rows)
    lines.append(f"\nmedian with / without: **{ratios[len(ratios) // 2]:.0%}**")
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
