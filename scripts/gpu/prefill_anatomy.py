#!/usr/bin/env python3
"""Anatomy of a lone request's prefill step in the worker's ModelRunner, without the actors
(issue 15): a new request with a P-token prompt per step, finished (first token sampled) and
dropped before the next. Prints the median host time of `runner.launch` (nothing in flight),
the step run to completion, and a cProfile of the launches: which Python functions the host
spends a prefill's launch in (the device work of a 128-token prefill of Qwen3-0.6B is ~1.4 ms;
the engine's launch was measured at ~23 ms on the H200).

    python scripts/gpu/prefill_anatomy.py [--model scripts/gpu/configs/qwen3-0.6b]
        [--prompt 128] [--iters 20] [--device cuda] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pagedserve.actors.messages import NewRequestData, SamplingParams, StepPlan  # noqa: E402
from pagedserve.actors.worker import startup  # noqa: E402
from pagedserve.actors.worker.model_runner import ModelRunner  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.kernels.attention_metadata import cdiv  # noqa: E402

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


class PrefillSession:
    """A fresh request per step: its whole prompt scheduled at once; dropped the step after."""

    def __init__(self, prompt_len: int, block_size: int) -> None:
        self.prompt_len, self.step_id, self.handle = prompt_len, 0, 1
        self.blocks = list(range(cdiv(prompt_len + 1, block_size)))
        self.previous: int | None = None

    def plan(self) -> StepPlan:
        tokens = [(13 * self.handle + t) % 1000 for t in range(self.prompt_len)]
        new = NewRequestData(self.handle, tokens, len(tokens), ONE_TOKEN, self.handle,
                             self.blocks, 0)  # fmt: skip
        finished = [] if self.previous is None else [self.previous]
        plan = StepPlan(step_id=self.step_id, new_requests=[new], scheduled=[self.handle],
                        num_scheduled_tokens=[self.prompt_len], finished=finished)  # fmt: skip
        self.previous, self.handle, self.step_id = self.handle, self.handle + 1, self.step_id + 1
        return plan


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(
    runner: ModelRunner, session: PrefillSession, iters: int, idle_s: float = 0.0
) -> tuple[float, float]:
    """Median ms of the launch and of the whole step; `idle_s` of sleep before each (the
    engine between a lone client's requests: process, CPU and GPU idle)."""
    launches, executes = [], []
    for _ in range(iters):
        sync(runner.device)
        time.sleep(idle_s)
        t0 = time.perf_counter()
        runner.launch(session.plan())
        t1 = time.perf_counter()
        runner.finish()
        sync(runner.device)
        launches.append(t1 - t0)
        executes.append(time.perf_counter() - t0)
    return statistics.median(launches) * 1e3, statistics.median(executes) * 1e3


def profiled(runner: ModelRunner, session: PrefillSession, iters: int) -> str:
    profiler = cProfile.Profile()
    for _ in range(iters):
        sync(runner.device)
        profiler.enable()
        runner.launch(session.plan())
        profiler.disable()
        runner.finish()
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("cumulative").print_stats(30)
    stats.sort_stats("tottime").print_stats(25)
    return stream.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(ROOT / "scripts/gpu/configs/qwen3-0.6b"))
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    # the decode graphs' rows: a prompt of at most this many tokens replays one (the engine's
    # static prefill), a longer one runs eagerly
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = EngineConfig(
        model=args.model, load_format="dummy", device=args.device, max_model_len=4096,
        max_num_seqs=args.max_num_seqs, num_kv_blocks=256, skip_tokenizer_init=True,
    ).resolve()  # fmt: skip
    runner = ModelRunner(config)
    runner.load_model()
    startup.init_kv_cache(runner, 256)
    session = PrefillSession(args.prompt, runner.block_size)
    timed(runner, session, 3)  # warm-up: compiles, allocator
    launch_ms, execute_ms = timed(runner, session, args.iters)
    idle_launch_ms, idle_execute_ms = timed(runner, session, args.iters, idle_s=0.02)
    path = "static (decode graph rows)" if runner.static_prefill else "eager"
    if runner.static_prefill and args.prompt > (runner.decode_step or runner).max_batch:
        path = "eager (longer than the decode graphs' rows)"
    if runner.prefill_step is not None and args.prompt <= runner.prefill_step.max_tokens:
        path = "prefill graphs"
    lines = [f"# Prefill anatomy: {Path(args.model).name}, {args.prompt}-token prompt, "
             f"{config.device}, {path} path", "",
             f"- host launch (nothing in flight): {launch_ms:.3f} ms (median of {args.iters})",
             f"- step to completion (first token sampled): {execute_ms:.3f} ms",
             f"- the same after 20 ms idle before each: launch {idle_launch_ms:.3f} ms, "
             f"step {idle_execute_ms:.3f} ms", "",
             "```", profiled(runner, session, args.iters), "```"]  # fmt: skip
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
