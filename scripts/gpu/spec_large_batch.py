#!/usr/bin/env python3
"""Why an engine configured for speculation runs batch 64 slower than a plain one (issue 12).

Above `disable_by_batch_size` a speculative engine plans what a plain one plans (on the CPU
byte for byte: tests/test_spec_switch.py), yet on the H200 its batch-64 throughput was
0.67-0.71x of plain (session 9). This runs the benchmark's flow (a batch-1 warm-up with
speculation on, then 64 x `--tokens` greedy requests: a warm-up run and a measured one) on
the `target` preset with dummy weights, for a plain engine, plain engines sized like the
speculative ones, and speculative ones switched off above batch 16, each with the loop timers
and the step log (ProfileConfig), and prints per config: the measured run's wall time and
steps, the worker's host and device time per steady step, the scheduler's phases per call,
and how many steps ran at each batch size (the whole engine's run).

    python scripts/gpu/spec_large_batch.py [--tokens 256] [--batch 64] [--runner-only |
        --engine-only] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))

import torch  # noqa: E402
from spec_anatomy import (  # noqa: E402
    DRAFT,
    SpecSession,
    git_revision,
    per_count,
    steady_steps,
    sync,
    target_dir,
    time_steps,
)

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.actors.worker import startup  # noqa: E402
from pagedserve.actors.worker.model_runner import ModelRunner  # noqa: E402
from pagedserve.config import EngineConfig, ProfileConfig, SpeculativeConfig  # noqa: E402

RUNS = 5  # measured runs per engine (wall: their median)
PROMPT = " ".join(["the king is dead, long live the king; the queen is here."] * 10)


def configs(limit: int, k: int) -> list[tuple[str, dict, bool]]:
    """(name, LLM kwargs, whether a batch-1 request runs first): plain, plain with the static
    rows of an n-gram k engine, and the speculative engines of bench_speculative.py switched
    off above batch `limit`."""
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
             "prompt_lookup_min": 2, "disable_by_batch_size": limit}  # fmt: skip
    draft = {"model": str(DRAFT), "num_speculative_tokens": 3, "disable_by_batch_size": limit}
    sized = 256 * (1 + k)  # the static decode rows of the n-gram engines
    return [
        ("no speculation", {}, True),
        (f"no speculation, max_num_seqs {sized}", {"max_num_seqs": sized}, True),
        (f"n-gram k={k}, 1 round, off above {limit}", {"speculative_config": ngram}, True),
        (f"n-gram k={k}, 4 rounds, off above {limit}",
         {"speculative_config": ngram | {"num_rounds": 4}}, True),
        (f"draft k=3, 4 rounds, off above {limit}",
         {"speculative_config": draft | {"num_rounds": 4}}, True),
        # which part costs: speculation never on, or no speculative step before the batch
        (f"n-gram k={k}, never on (disable_by_batch_size 0)",
         {"speculative_config": ngram | {"disable_by_batch_size": 0}}, True),
        (f"n-gram k={k}, off above {limit}, no batch-1 warm-up",
         {"speculative_config": ngram}, False),
        ("no speculation (again, last)", {}, True),
    ]  # fmt: skip


def runner_configs(k: int) -> list[tuple[str, dict]]:
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=k, disable_by_batch_size=16)
    sized = 256 * (1 + k)
    return [
        ("max_num_seqs 256", {"max_num_seqs": 256}),
        (f"max_num_seqs {sized}", {"max_num_seqs": sized}),
        (f"max_num_seqs 256, n-gram k={k}", {"max_num_seqs": 256, "speculative_config": ngram}),
        ("max_num_seqs 256 (again)", {"max_num_seqs": 256}),
    ]


def runner_row(target: Path, name: str, kwargs: dict, batch: int, device: str) -> list[str]:
    """The worker's ModelRunner alone (no actors): plain decode steps of `batch` requests with
    200 tokens of context, launched back to back as the engine does (ms per step over 200),
    run to completion one at a time (median ms), and the device's top kernels over 20."""
    config = EngineConfig(
        model=str(target), load_format="dummy", device=device, dtype="bfloat16",
        max_model_len=1024, num_kv_blocks=4096, skip_tokenizer_init=True, **kwargs,
    ).resolve()  # fmt: skip
    runner = ModelRunner(config)
    runner.load_model()
    startup.compile_kernels_ahead(runner)
    startup.init_kv_cache(runner, 4096)
    session = SpecSession(runner, batch, 200, 0, 4)
    session.step(False)  # the prompts' first token

    def pipelined(steps: int) -> float:
        sync(runner.device)
        start = time.perf_counter()
        for _ in range(steps):
            runner.launch(session.plan(False))
            for handle in session.ids:
                session.num_computed[handle] += 1
        runner.finish()
        sync(runner.device)
        return (time.perf_counter() - start) / steps * 1e3

    pipelined(20)
    per_step = pipelined(200)
    synced, _ = time_steps(session, False, 30)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        pipelined(20)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    device_ms = sum(e.device_time_total for e in events) / 20 / 1e3
    top = ", ".join(f"{e.key[:60]} {e.device_time_total / 20:.0f} us" for e in events[:6])
    runner.close()
    return [f"| {name} | {per_step:.3f} | {synced:.3f} | {device_ms:.3f} |", f"- {name}: {top}"]


def run(target: Path, name: str, kwargs: dict, batch1_warm_up: bool, batch: int, tokens: int,
        device: str) -> tuple[str, str]:  # fmt: skip
    out = Path(tempfile.mkdtemp(prefix="spec_large_batch_"))
    profile = ProfileConfig(output_dir=str(out), first_step=10**9, num_steps=0)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    with LLM(str(target), load_format="dummy", max_model_len=1024, device=device,
             profile=profile, **kwargs) as llm:  # fmt: skip
        if batch1_warm_up:
            llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
        llm.generate([PROMPT] * batch, params, use_tqdm=False)  # warm-up at this batch
        gc.collect()
        gc.freeze()  # this process's heap out of the collections, as the actors' are
        before = llm.get_stats()
        walls = []
        for _ in range(RUNS):
            start = time.perf_counter()
            outputs = llm.generate([PROMPT] * batch, params, use_tqdm=False)
            walls.append(time.perf_counter() - start)
        after = llm.get_stats()
    wall = statistics.median(walls)
    emitted = sum(len(o.outputs[0].token_ids) for o in outputs)
    steps = (after.num_steps - before.num_steps) // RUNS
    log = json.loads((out / "worker0.steps.json").read_text())
    worker = json.loads((out / "worker0.loop.json").read_text())
    scheduler = json.loads((out / "scheduler.loop.json").read_text())
    host_ms, device_ms = steady_steps(log)
    row = (
        f"| {name} | {wall:.3f} | {emitted / wall:,.0f} | {steps} | "
        f"{wall / max(steps, 1) * 1e3:.3f} | {host_ms:.3f} | {device_ms:.3f} | "
        f"{per_count(worker, 'finish'):.3f} | {per_count(scheduler, 'plan'):.3f} | "
        f"{per_count(scheduler, 'handle'):.3f} | {per_count(scheduler, 'send_outputs'):.3f} | "
        f"{after.spec_num_drafts - before.spec_num_drafts} | {min(walls):.3f}-{max(walls):.3f} |"
    )
    top = list(log["steps_by_batch"].items())[:8]
    histogram = f"- {name}: " + ", ".join(f"{kind}: {count}" for kind, count in top)
    return row, histogram


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--disable-above", type=int, default=16)
    parser.add_argument("--ngram-k", type=int, default=4, help="the n-gram engines' k")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--runner-only", action="store_true")
    parser.add_argument("--engine-only", action="store_true")
    parser.add_argument("--only", nargs="*", help="the engine configs whose name holds one")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    target = target_dir(Path(tempfile.mkdtemp(prefix="target_94m_")))
    lines = [
        f"# Batch {args.batch} with speculation configured "
        f"({datetime.datetime.now():%Y-%m-%d %H:%M}, {args.device})\n",
        f"command: `python scripts/gpu/spec_large_batch.py {' '.join(sys.argv[1:])}` at "
        f"{git_revision()}\n",
        f"Target: the `target` preset, dummy weights, bf16; {args.batch} x {args.tokens} greedy "
        f"tokens (ignore_eos), the median of {RUNS} runs after a warm-up run (steps: per run). "
        "Worker host and device: ms per steady step (StepLog); loop-timer columns: ms per call "
        "over the whole run.\n",
        "| config | wall s | tok/s | steps | ms/step | worker host | device | worker finish "
        "| sched. plan | sched. handle | sched. send | verifies | wall range |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    runner_lines = [
        f"\nThe ModelRunner alone, {args.batch} plain decodes of 200-token contexts:\n",
        "| runner | ms/step, launched back to back | ms/step, run to completion | "
        "device kernels ms/step |",
        "|---|---:|---:|---:|",
    ]
    runner_tops = []
    for name, kwargs in [] if args.engine_only else runner_configs(args.ngram_k):
        try:
            row, top = runner_row(target, name, kwargs, args.batch, args.device)
        except Exception as error:  # one failing config leaves the others' rows
            row, top = f"| {name} | failed: {type(error).__name__}: {error} |", ""
        runner_lines.append(row)
        runner_tops.append(top)
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        print(row, top, sep="\n", flush=True)
    histograms = ["\nSteps per (kind, batch size), whole run, most frequent first:\n"]
    chosen = [c for c in configs(args.disable_above, args.ngram_k) if not args.only or any(
        word in c[0] for word in args.only)]  # fmt: skip
    for name, kwargs, batch1_warm_up in [] if args.runner_only else chosen:
        try:
            row, histogram = run(target, name, kwargs, batch1_warm_up, args.batch, args.tokens,
                                 args.device)  # fmt: skip
        except Exception as error:  # one failing config leaves the others' rows
            row, histogram = f"| {name} | failed: {type(error).__name__}: {error} |", ""
        lines.append(row)
        histograms.append(histogram)
        print(row, histogram, sep="\n", flush=True)
    text = "\n".join(lines + histograms + runner_lines + [""] + runner_tops) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
