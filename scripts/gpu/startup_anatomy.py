"""Where the engine's start-up time goes, on the GPU machine: the import time of each actor's
module (python -X importtime, in a fresh interpreter), then the worker's set-up steps in this
process (CUDA context, ModelRunner, load_model under cProfile, memory profile, KV cache,
kernel warm-up and CUDA graphs).

    python scripts/gpu/startup_anatomy.py --out FILE [--model DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
QWEN = str(ROOT / "scripts" / "gpu" / "configs" / "qwen3-0.6b")
MODULES = {
    "worker": "pagedserve.actors.worker.actor",
    "tokenizer": "pagedserve.actors.tokenizer",
    "scheduler": "pagedserve.actors.scheduler.actor",
}


def import_times(module: str, top: int) -> list[str]:
    """The slowest imports (cumulative µs) of `module` in a fresh interpreter."""
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )  # fmt: skip
    wall = time.perf_counter() - start
    rows = []
    for line in run.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = line.split("|", 2)
        rows.append((int(cumulative), name.strip()))
    rows.sort(reverse=True)
    lines = [f"- `{module}`: interpreter + imports {wall:.2f} s wall; slowest (cumulative s):"]
    lines += [f"  - {name}: {us / 1e6:.2f}" for us, name in rows[:top]]
    if run.returncode:
        lines.append(f"  - FAILED: {run.stderr[-500:]}")
    return lines


def profile_top(profiler: cProfile.Profile, top: int) -> list[str]:
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("cumulative").print_stats(top)
    return ["```", *stream.getvalue().strip().splitlines()[-top - 2 :], "```"]


def worker_steps(model: str) -> list[str]:
    import torch

    from pagedserve.actors.worker import startup
    from pagedserve.actors.worker.model_runner import ModelRunner
    from pagedserve.config import EngineConfig

    lines, timings = [], {}

    def timed(name: str, start: float) -> None:
        torch.cuda.synchronize()
        timings[name] = time.perf_counter() - start

    start = time.perf_counter()
    torch.empty(1, device="cuda")
    timed("CUDA context", start)
    config = EngineConfig(model=model, load_format="dummy", skip_tokenizer_init=True,
                          max_model_len=4096, device="cuda").resolve()  # fmt: skip
    start = time.perf_counter()
    runner = ModelRunner(config)
    timed("ModelRunner()", start)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    runner.load_model()
    profiler.disable()
    timed("load_model (under cProfile)", start)
    start = time.perf_counter()
    num_blocks = startup.num_kv_blocks(runner)
    timed("memory profile", start)
    start = time.perf_counter()
    startup.init_kv_cache(runner, num_blocks)
    timed("KV cache + warm-up + graphs", start)
    lines.append("| step | s |")
    lines.append("|---|---:|")
    lines += [f"| {name} | {s:.2f} |" for name, s in timings.items()]
    lines += [f"| runner.setup_seconds | {runner.setup_seconds} |", "", "load_model, cProfile:"]
    lines += profile_top(profiler, 25)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default=QWEN)
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    lines = ["# Start-up anatomy\n", "## Imports of each actor's module (fresh interpreter)\n"]
    for module in MODULES.values():
        lines += import_times(module, args.top)
    lines += ["", f"## Worker set-up steps in one process ({Path(args.model).name} dummy)\n"]
    lines += worker_steps(args.model)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
