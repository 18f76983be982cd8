#!/usr/bin/env python3
"""Where a lone request's first token goes (issue 15): batch-1 128-token prompts, one token
each, sent one at a time through the ZeroMQ client to an engine with profiling on. Prints the
client's time to first token next to the worker's own view of the same steps (StepLog: host
time of each step's launch and its device time, by kind), the loop timers of the worker and
the scheduler (where their wall time went), each hop of the request's own timeline (client
-> scheduler -> worker -> scheduler -> detokenizer -> client; actors/timeline.py), and a
torch.profiler window over a few of the prefill steps (device busy fraction, kernels per
step, the largest gaps).

    python scripts/gpu/first_token_anatomy.py [--models qwen3-0.6b llama-3.1-8b] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pagedserve import SamplingParams  # noqa: E402
from pagedserve.actors.supervisor import Supervisor  # noqa: E402
from pagedserve.actors.timeline import FIRST_TOKEN_PATH, first_token_marks  # noqa: E402
from pagedserve.api import bench  # noqa: E402
from pagedserve.api.client import Client  # noqa: E402
from pagedserve.config import EngineConfig, ProfileConfig  # noqa: E402

CONFIGS = ROOT / "scripts" / "gpu" / "configs"
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
WARMUP, MEASURED = 10, 30


def client_ttfts(
    address: str, credentials: object, prompts: list[list[int]]
) -> list[tuple[float, float]]:
    """(sent, first token received) of each prompt, perf_counter seconds."""
    times = []
    with Client(address, credentials=credentials) as client:
        for prompt in prompts:
            start = time.perf_counter()
            next(iter(client.generate(prompt, ONE_TOKEN)))
            times.append((start, time.perf_counter()))
            time.sleep(0.02)  # the engine idles between requests, as a lone client's would
    return times


HOPS = (
    ["client -> scheduler"]
    + [f"{a[1]} -> {b[1]}" for a, b in zip(FIRST_TOKEN_PATH, FIRST_TOKEN_PATH[1:])]
    + ["detok_out -> client"]
)


def hop_table(directory: Path, client_times: list[tuple[float, float]]) -> list[str]:
    """Median µs of each hop of the measured requests' first tokens (the actors' timelines
    joined with the client's own send and receive times)."""
    engine = first_token_marks(str(directory))
    if len(engine) != len(client_times):
        return [f"timeline: {len(engine)} joined requests for {len(client_times)} sent: skipped"]
    hops: list[list[float]] = [[] for _ in HOPS]
    for (sent, received), marks in list(zip(client_times, engine))[WARMUP:]:
        path = [sent, *marks, received]
        for index, (a, b) in enumerate(zip(path, path[1:])):
            hops[index].append((b - a) * 1e6)
    lines = ["| hop | median µs | p90 µs |", "|---|---:|---:|"]
    for name, values in zip(HOPS, hops):
        values.sort()
        lines.append(f"| {name} | {statistics.median(values):.0f} | "
                     f"{values[int(0.9 * (len(values) - 1))]:.0f} |")  # fmt: skip
    return lines


def anatomy(model: str, device: str) -> list[str]:
    out = Path(tempfile.mkdtemp())
    profile = ProfileConfig(output_dir=str(out), first_step=WARMUP + 12, num_steps=6)
    config = EngineConfig(
        model=model, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
        device=device, profile=profile,
    )  # fmt: skip
    workload = bench.random_workload(WARMUP + MEASURED, (128, 128), (1, 1), 1000, seed=3)
    prompts = [prompt for prompt, _ in workload]
    supervisor = Supervisor(config)
    supervisor.start()
    try:
        address = supervisor.addresses.engine_address
        client_times = client_ttfts(address, supervisor.credentials.for_clients(), prompts)
    finally:
        supervisor.stop()
    measured = sorted((end - start) * 1e3 for start, end in client_times[WARMUP:])
    summary = (
        f"client TTFT ms: p50 {statistics.median(measured):.2f}, min {measured[0]:.2f}, "
        f"max {measured[-1]:.2f} ({len(measured)} requests after {WARMUP} warm-up)"
    )
    lines = [f"## {Path(model).name}", "", summary, ""]
    lines += ["Where the first token's time goes (request timeline, profiling on):", ""]
    lines += [*hop_table(out, client_times), ""]
    steps = json.loads((out / "worker0.steps.json").read_text())
    lines += ["| step kind | steps | tokens | host ms / step | device ms / step | compile s |",
              "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for kind, t in steps["by_kind"].items():
        n = max(t["steps"], 1)
        lines.append(f"| {kind} | {t['steps']} | {t['tokens']} | {1e3 * t['host_s'] / n:.3f} | "
                     f"{1e3 * t['device_s'] / n:.3f} | {t['compile_s']:.3f} |")  # fmt: skip
    lines.append("")
    for name in ("worker0.loop.json", "scheduler.loop.json", "worker0.idle.json"):
        path = out / name
        text = json.dumps(json.loads(path.read_text())) if path.exists() else "absent"
        lines.append(f"- {name}: {text}")
    kernels = out / "worker0.kernels.json"
    if kernels.exists():
        table = json.loads(kernels.read_text())
        launches = sum(k["per_step"] for k in table)
        lines += ["", f"kernels per profiled step: {launches:.0f}; the largest by device time:"]
        lines += [f"- {k['us_per_step']:.1f} µs x{k['per_step']:.0f} {k['name'][:90]}"
                  for k in table[:12]]  # fmt: skip
    lines.append("")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lines = ["# First-token anatomy (batch 1, 128-token prompt, 1 output token)", ""]
    for name in args.models:
        model = name if Path(name).exists() else str(CONFIGS / name)
        lines += anatomy(model, args.device)
        print("\n".join(lines), flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
