"""Scheduler alone: what its memory holds after N finished requests of the soak's sizes.

A real `Scheduler` (the soak's engine settings: 1,024 KV blocks of 16) is driven by a worker
stand-in that samples a token at the end of each request's known tokens, `--concurrency`
requests at a time, of the sizes scripts/soak.py sends (prompts of 3-84 tokens, 1-64 output
tokens, token ids of the embedded model's vocabulary). It prints the process's RSS and the
Python memory traced (tracemalloc) at each mark, then the allocation sites that grew from the
first mark to the last: what the scheduler keeps per finished request. tracemalloc's own
tables grow the RSS too; `--no-trace` gives the RSS alone.

    python scripts/profile/scheduler_memory.py --requests 8000 --marks 1000 4000
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import tracemalloc
from collections import deque

import psutil

from pagedserve.actors.messages import AddRequest, SamplingParams, StepPlan, StepResult
from pagedserve.actors.scheduler.scheduler import Scheduler
from pagedserve.config import EngineConfig

VOCAB = 4096


class Worker:
    """Knows each request's length and computed tokens; samples at the end of what it knows."""

    def __init__(self, rng: random.Random) -> None:
        self.known: dict[int, list[int]] = {}
        self.rng = rng

    def execute(self, plan: StepPlan) -> StepResult:
        for handle in plan.finished:
            self.known.pop(handle, None)
        for new in plan.new_requests:
            self.known[new.handle] = [len(new.token_ids), new.num_computed_tokens]
        handles, tokens = [], []
        for handle, n in zip(plan.scheduled, plan.num_scheduled_tokens):
            known = self.known[handle]
            known[1] += n
            if known[1] >= known[0]:
                known[0] += 1
                handles.append(handle)
                tokens.append(self.rng.randrange(1, VOCAB))
        return StepResult(step_id=plan.step_id, handles=handles, sampled_token_ids=tokens)


def request(rng: random.Random, seq: int) -> AddRequest:
    prompt = [rng.randrange(257, VOCAB) for _ in range(rng.randint(3, 84))]
    sampling = SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(1, 64))
    return AddRequest(
        client=os.urandom(5), seq=seq, prompt_token_ids=prompt, sampling=sampling,
        eos_token_ids=[0],
    )  # fmt: skip


def mark(scheduler: Scheduler, done: int) -> tracemalloc.Snapshot | None:
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] / 2**20
    rss = psutil.Process().memory_info().rss / 2**20
    kept = len(scheduler.routes.finished)
    print(f"| {done} | {rss:.1f} | {traced:.2f} | {kept} | {scheduler.routes.finished_bytes} |")
    return tracemalloc.take_snapshot() if tracemalloc.is_tracing() else None


def run(args: argparse.Namespace) -> None:
    scheduler = Scheduler(EngineConfig(), num_kv_blocks=1024)
    rng, worker = random.Random(0), Worker(random.Random(1))
    pending: deque[StepResult] = deque()
    marks, snapshots, seq = set(args.marks) | {args.requests}, [], 0
    print("| requests | RSS MiB | traced MiB | finished kept | their frames' bytes |")
    print("|---:|---:|---:|---:|---:|")
    while seq < args.requests or scheduler.requests:
        while seq < args.requests and len(scheduler.requests) < args.concurrency:
            scheduler.add_request(request(rng, seq))
            seq += 1
            if seq in marks:
                snapshots.append(mark(scheduler, seq))
        plan = scheduler.schedule() if len(pending) < 2 else None
        if plan is not None:
            pending.append(worker.execute(plan))
        if pending and (plan is None or len(pending) == 2):
            scheduler.update_from_result(pending.popleft())
    if snapshots[0] is None:
        return
    print(f"\nGrowth from {min(marks)} to {args.requests} requests, by allocation site:\n")
    for stat in snapshots[-1].compare_to(snapshots[0], "lineno")[: args.top]:
        print(f"- {stat}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8000)
    parser.add_argument("--marks", type=int, nargs="+", default=[1000, 2000, 4000])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--no-trace", action="store_true", help="RSS only")
    args = parser.parse_args()
    if not args.no_trace:
        tracemalloc.start()
    run(args)


if __name__ == "__main__":
    main()
