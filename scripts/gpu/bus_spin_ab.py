#!/usr/bin/env python3
"""The inboxes' spin (EngineConfig.bus_spin_us) on the engine, A/B (issue 11's bus, issue 15's
latency): W3's batch-1 request (128-token prompt, 256 output tokens, greedy, streamed through
the ZeroMQ client) with the scheduler's and the worker's inboxes spinning (the default on a
machine of 8 CPUs or more) and not (bus_spin_us=0), engines interleaved; time per output token
and time to the first token, medians of --iters requests each.

    python scripts/gpu/bus_spin_ab.py [--models qwen3-0.6b llama-3.1-8b] [--repeat 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pagedserve.api import bench  # noqa: E402
from pagedserve.config import default_bus_spin_us  # noqa: E402
from pagedserve.cpus import usable_cpus  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.1-8b"])
    parser.add_argument("--repeat", type=int, default=2, help="engines of each setting")
    parser.add_argument("--iters", type=int, default=5, help="timed requests per engine")
    args = parser.parse_args()
    cpus = usable_cpus()
    print(f"spin where unset: {default_bus_spin_us('cuda', cpus)} µs ({cpus} CPUs)\n")
    print("| model | bus_spin_us | engine | ms per output token | TTFT ms |")
    print("|---|---:|---:|---:|---:|")
    for model in args.models:
        for run in range(args.repeat):
            for spin_us in (0, None):
                settings = dict(
                    model=str(ROOT / "scripts" / "gpu" / "configs" / model),
                    load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
                    device="cuda", max_num_seqs=8, bus_spin_us=spin_us,
                )  # fmt: skip
                got = bench.latency_pagedserve(settings, 128, 256, iters=args.iters)
                label = "default" if spin_us is None else spin_us
                print(f"| {model} | {label} | {run + 1} | {got['tpot_ms']:.3f} | "
                      f"{got['ttft_ms']:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
