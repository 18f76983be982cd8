#!/usr/bin/env python3
"""Speculative decoding's settings on the H200 (issue 12): k and rounds at batch 1, and where a
batch-64 step of a speculative engine with speculation off spends its time.

1. Trains the `target` preset as bench_speculative.py does (the embedded 4M model drafts).
2. Batch 1, greedy, 256 tokens, through the ZeroMQ client (bench_speculative.time_per_token):
   no speculation, n-gram (copy prompts) and draft (Shakespeare prompts) for several k and
   num_rounds. Per row: ms per token, its speed-up over the mean of the plain engines (first
   and last), acceptance, mean accepted length, and per engine step (one plan's round trip):
   tokens, wall ms, and the worker's launch ms (its StepLog).
   py-spy records the worker over further runs of three of them (SPIED).
3. Batch 64 x 256 (--batch64): plain, n-gram and draft engines (speculation off above batch
   16) in turn, twice; their tok/s (median of 7 after a warm-up), each with py-spy recording
   the worker and the scheduler (non-blocking, idle samples included) over further runs.
   The tables give each function's share of the main thread's wall time, an engine a column.
   Needs --py-spy PATH (a py-spy binary).

    python scripts/gpu/spec_tuning.py --data .gpu_data/data --out FILE [--batch64 --py-spy BIN]

(py-spy: scripts/gpu/fetch_wheels.sh downloads it; after run.sh install it is /tmp/site/bin/py-spy.)
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))

from bench_speculative import (  # noqa: E402
    COPY_PROMPTS,
    DRAFT,
    PROMPTS,
    throughput,
    time_per_token,
    train_target,
)
from spec_anatomy import steady_steps  # noqa: E402

from pagedserve import LLM  # noqa: E402
from pagedserve.api.bench import spec_decode_summary  # noqa: E402
from pagedserve.config import ProfileConfig  # noqa: E402

NGRAM = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def batch1_configs() -> list[tuple[str, dict | None, str]]:
    """(name, speculative_config, prompt set) per engine."""
    ngram = lambda k, r: NGRAM | {"num_speculative_tokens": k, "num_rounds": r}  # noqa: E731
    draft = lambda k, r: {"model": DRAFT, "num_speculative_tokens": k, "num_rounds": r}  # noqa: E731
    rows: list[tuple[str, dict | None, str]] = [("no speculation", None, "both")]
    for k, r in ((4, 4), (4, 8), (8, 8), (8, 16)):
        rows.append((f"ngram k={k}, {r} rounds", ngram(k, r), "copy"))
    for k, r in ((2, 8), (3, 4)):
        rows.append((f"draft k={k}, {r} rounds", draft(k, r), "shakespeare"))
    return [*rows, ("no speculation (last)", None, "both")]


SPIED = ("ngram k=8, 16 rounds", "draft k=3, 4 rounds", "no speculation (last)")


def spy(py_spy: str, actors: tuple[str, ...], out: Path, name: str, work: Callable[[], object],
        seconds: float = 5.0) -> dict[str, collections.Counter]:  # fmt: skip
    """Run `work` repeatedly for about `seconds` while py-spy records the actors (idle
    samples included, non-blocking); each actor's function shares (function_shares)."""
    spies = []
    for actor in actors:
        pids = pids_of(f"pagedserve:{actor}")
        if not pids:
            continue
        slug = re.sub(r"\W+", "_", name)
        raw = out / f"pyspy_{slug}_{actor}.txt"
        spies.append((actor, raw, subprocess.Popen(
            [py_spy, "record", "--pid", str(pids[0]), "--duration", str(int(seconds) + 1),
             "--rate", "400", "--nonblocking", "--idle", "--format", "raw", "-o", str(raw)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)))  # fmt: skip
    time.sleep(0.5)
    end = time.perf_counter() + seconds - 0.5
    while time.perf_counter() < end:
        work()
    recorded = {}
    for actor, raw, process in spies:
        _, err = process.communicate(timeout=60)
        if process.returncode:
            print(f"py-spy {actor}: rc {process.returncode}: {err[-400:]}", flush=True)
        recorded[actor] = function_shares(raw)
    return recorded


def batch1_row(target: str, name: str, spec: dict | None, prompts_name: str, py_spy: str,
               out_dir: Path, profiles: dict) -> list[dict]:  # fmt: skip
    extra = {} if spec is None else {"speculative_config": spec}
    sets = {"shakespeare": PROMPTS, "copy": COPY_PROMPTS}
    if prompts_name != "both":
        sets = {prompts_name: sets[prompts_name]}
    out = Path(tempfile.mkdtemp(prefix="spec_tuning_"))
    profile = ProfileConfig(output_dir=str(out), first_step=10**9, num_steps=0)
    rows = []
    with LLM(target, max_model_len=1024, profile=profile, **extra) as llm:
        for prompts_name, prompts in sets.items():
            time_per_token(llm, prompts[:1], 32)  # warm-up: kernels, graphs
            before = llm.get_stats()
            start = time.perf_counter()
            ms = time_per_token(llm, prompts, 256) * 1e3
            wall = time.perf_counter() - start
            after = llm.get_stats()
            steps = max(after.num_steps - before.num_steps, 1)
            emitted = after.num_generation_tokens - before.num_generation_tokens
            row = {"config": name, "prompts": prompts_name, "ms_per_token": round(ms, 3),
                   "tokens_per_step": round(emitted / steps, 2),
                   "wall_ms_per_step": round(wall / steps * 1e3, 3)}  # fmt: skip
            if spec is not None:
                row |= spec_decode_summary(before, after)
            rows.append(row)
        if name in SPIED:
            prompts = sets.get("copy", PROMPTS)
            profiles[name] = spy(py_spy, ("worker0",), out_dir, name,
                                 lambda: time_per_token(llm, prompts, 256))  # fmt: skip
    host_ms, device_ms = steady_steps(json.loads((out / "worker0.steps.json").read_text()))
    for row in rows:  # the StepLog covers the engine's whole run
        row["worker_launch_ms"], row["device_ms"] = round(host_ms, 3), round(device_ms, 3)
        print(json.dumps(row), flush=True)
    shutil.rmtree(out, ignore_errors=True)
    return rows


def add_speedups(rows: list[dict]) -> None:
    plain: dict[str, list[float]] = collections.defaultdict(list)
    for row in rows:
        if row["config"].startswith("no speculation"):
            plain[row["prompts"]].append(row["ms_per_token"])
    for row in rows:
        base = plain.get(row["prompts"])
        if base:
            row["speedup"] = round(sum(base) / len(base) / row["ms_per_token"], 2)


def pids_of(title: str) -> list[int]:
    """The processes whose command line (a process title) starts with `title`."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if cmdline.read_bytes().startswith(title.encode()):
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


def function_shares(raw: Path) -> collections.Counter:
    """Per function (file and line left out): the share of the main thread's samples (idle
    ones included: the wall time) whose stack holds it, from a py-spy raw (collapsed) file."""
    counts: collections.Counter = collections.Counter()
    total = 0
    if not raw.exists():
        return counts
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not (stack and n.isdigit()) or "_run_module_as_main" not in stack:
            continue
        total += int(n)
        for function in {frame.split(" (")[0] for frame in stack.split(";")}:
            counts[function] += int(n)
    return collections.Counter({f: c / max(total, 1) for f, c in counts.items()})


def batch64_engine(target: str, name: str, spec: dict | None, py_spy: str, out: Path
                   ) -> tuple[dict, dict[str, collections.Counter]]:  # fmt: skip
    extra = {} if spec is None else {"speculative_config": spec}
    with LLM(target, max_model_len=1024, **extra) as llm:
        tok_s = throughput(llm, PROMPTS, 64, 256)
        recorded = spy(py_spy, ("worker0", "scheduler"), out, name,
                       lambda: throughput(llm, PROMPTS, 64, 256), seconds=4.0)  # fmt: skip
    row = {"config": name, "batch64_tok_s": round(tok_s)}
    print(json.dumps(row), flush=True)
    return row, recorded


def profile_table(profiles: dict[str, dict[str, collections.Counter]], actor: str, label: str
                  ) -> list[str]:  # fmt: skip
    """The functions whose share of the wall time differs most between the engines (and the
    largest ones), a column per engine."""
    names = list(profiles)
    shares = [profiles[n].get(actor, collections.Counter()) for n in names]
    functions = {f for f in set().union(*shares) if min(p[f] for p in shares) < 0.999}
    spread = {f: max(p[f] for p in shares) - min(p[f] for p in shares) for f in functions}
    top = sorted(functions, key=lambda f: -max(p[f] for p in shares))[:25]
    top += [f for f in sorted(functions, key=lambda f: -spread[f])[:25] if f not in top]
    lines = [f"\n### {label}, {actor}: share of the main thread's wall time (stacks holding it)\n",
             "| function | " + " | ".join(names) + " |",
             "|---|" + "---:|" * len(names)]  # fmt: skip
    lines += [f"| `{f[:100]}` | " + " | ".join(f"{p[f]:.1%}" for p in shares) + " |" for f in top]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--train-seconds", type=int, default=120)
    parser.add_argument("--batch64", action="store_true")
    parser.add_argument("--no-batch1", action="store_true")
    parser.add_argument("--py-spy", default="py-spy")
    parser.add_argument("--target", help="a model directory to use instead of training one")
    args = parser.parse_args()
    out = Path(args.out)
    if args.target:
        target, training = Path(args.target), {"model": args.target}
    else:
        target = Path("/tmp/target-94m")
        shutil.rmtree(target, ignore_errors=True)
        training = train_target(args.data, target, args.train_seconds)
    print(json.dumps(training), flush=True)
    lines = [f"## Speculative settings, {datetime.datetime.now():%Y-%m-%d %H:%M} (issue 12)", "",
             f"Target: {json.dumps(training)}", ""]  # fmt: skip
    if not args.no_batch1:
        rows, profiles1 = [], {}
        for name, spec, prompts_name in batch1_configs():
            try:
                rows += batch1_row(str(target), name, spec, prompts_name, args.py_spy,
                                   out.parent, profiles1)  # fmt: skip
            except Exception as error:  # one failing config leaves the others' rows
                print(f"{name}: failed: {type(error).__name__}: {error}", flush=True)
        add_speedups(rows)
        header = ["config", "prompts", "ms_per_token", "speedup", "acceptance_rate",
                  "mean_accepted_length", "tokens_per_step", "wall_ms_per_step",
                  "worker_launch_ms", "device_ms"]  # fmt: skip
        lines += ["### Batch 1, 256 greedy tokens", "", "| " + " | ".join(header) + " |",
                  "|" + "---|" * len(header)]  # fmt: skip
        lines += ["| " + " | ".join(str(r.get(h, "")) for h in header) + " |" for r in rows]
        lines += profile_table(profiles1, "worker0", "batch 1")
        lines += ["", "```json", json.dumps(rows, indent=1), "```"]
    if args.batch64:
        profiles, rows64 = {}, []
        off = {"disable_by_batch_size": 16, "num_rounds": 4}
        engines = [("plain", None), ("ngram k=4 off above 16", NGRAM | off | {
            "num_speculative_tokens": 4}), ("draft k=3 off above 16", off | {
            "model": DRAFT, "num_speculative_tokens": 3})] * 2  # fmt: skip
        engines = [(f"{name} ({i // 3 + 1})", spec) for i, (name, spec) in enumerate(engines)]
        for name, spec in engines:
            row, profiles[name] = batch64_engine(str(target), name, spec, args.py_spy, out.parent)
            rows64.append(row)
        lines += ["", "### Batch 64 x 256, tok/s (engines in this order)", "",
                  "| engine | tok/s |", "|---|---:|"]  # fmt: skip
        lines += [f"| {r['config']} | {r['batch64_tok_s']} |" for r in rows64]
        lines += profile_table(profiles, "worker0", "batch 64")
        lines += profile_table(profiles, "scheduler", "batch 64")
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
