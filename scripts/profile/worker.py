"""Worker alone: decode steps per second and step latency at a batch size, plan in to result out.

The worker actor runs as in the engine (its own process, the model, the KV cache); the profiler
is its scheduler: a reset plan admitting N requests (the prefill), then decode plans (the
columnar diff, one token each, a new block when one fills), each answered by a StepResult. It
keeps `--inflight` plans at the worker, as the scheduler does. Each batch size is a new
scheduler epoch (a worker ignores plans of an older scheduler than the one that reset it).

    python scripts/profile/worker.py --batch 1 32 256 --steps 200
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import anyio
from harness import SoloActor, latency_cells, percentiles, row

from pagedserve.actors import bus
from pagedserve.actors.messages import (
    EPOCH_SHIFT,
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerInbound,
    StepPlan,
    WorkerInbound,
)
from pagedserve.config import EngineConfig

PROMPT_LEN = 32
BLOCK_SIZE = 16


def plans(batch: int, steps: int, blocks_each: int, epoch: int) -> Iterator[StepPlan]:
    """The prefill plan (a reset), then decode plans (one token a request), of a scheduler
    of `epoch`."""
    greedy = SamplingParams(temperature=0.0, max_tokens=steps + 1)
    handles = [(epoch << EPOCH_SHIFT) + i for i in range(batch)]
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(batch)]
    step_id = epoch << EPOCH_SHIFT
    new = [NewRequestData(h, [1 + (h + j) % 300 for j in range(PROMPT_LEN)], PROMPT_LEN, greedy,
                          7, tables[i][:2], 0) for i, h in enumerate(handles)]  # fmt: skip
    yield StepPlan(step_id=step_id, new_requests=new, scheduled=handles,
                   num_scheduled_tokens=[PROMPT_LEN] * batch, reset=True)  # fmt: skip
    for step in range(steps):
        position = PROMPT_LEN + step
        grow = position % BLOCK_SIZE == 0 and position // BLOCK_SIZE >= 2
        new_blocks = [t[position // BLOCK_SIZE] for t in tables] if grow else []
        yield StepPlan(
            step_id=step_id + 1 + step,
            cached_requests=CachedRequestData([position] * batch, [int(grow)] * batch, new_blocks),
            scheduled=handles, num_scheduled_tokens=[1] * batch,
        )  # fmt: skip


async def measure(
    actor: SoloActor, batch: int, steps: int, inflight: int, epoch: int = 1
) -> dict[str, float]:
    """Steps per second and result latencies of `steps` decode steps of `batch` requests,
    as a scheduler of `epoch` (above the previous measure's: its reset drops that batch)."""
    ctx = actor.peer_context()
    results: bus.Receiver = bus.Receiver(ctx, actor.addresses.scheduler_inbox, SchedulerInbound)
    worker: bus.Sender[WorkerInbound] = bus.Sender(ctx, actor.addresses.worker_inbox(0), bind=True)
    blocks_each = (PROMPT_LEN + steps) // BLOCK_SIZE + 2
    sent: dict[int, float] = {}
    samples: list[float] = []
    pending = 0
    start = 0.0
    for index, plan in enumerate(plans(batch, steps, blocks_each, epoch)):
        if index == 1:
            start = time.perf_counter()
        sent[plan.step_id] = time.perf_counter()
        await worker.send(plan)
        pending += 1
        while pending >= inflight or (index == 0 and pending):
            result = await results.recv()
            pending -= 1
            if index:
                samples.append(time.perf_counter() - sent[result.step_id])
    while pending:
        result = await results.recv()
        samples.append(time.perf_counter() - sent[result.step_id])
        pending -= 1
    elapsed = time.perf_counter() - start
    ctx.destroy(linger=0)
    return {"steps_per_s": steps / elapsed, **percentiles(samples)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--inflight", type=int, default=3)
    args = parser.parse_args()
    blocks = max(args.batch) * ((PROMPT_LEN + args.steps) // BLOCK_SIZE + 2)
    config = EngineConfig(num_kv_blocks=blocks, max_num_seqs=max(args.batch))
    actor = SoloActor("worker", config)
    try:
        print(row(["batch", "decode steps/s", "tokens/s", "result latency µs p50", "p90", "p99"]))
        print(row(["---:"] * 6))
        for epoch, batch in enumerate(args.batch, start=1):
            r = anyio.run(measure, actor, batch, args.steps, args.inflight, epoch)
            rates = [f"{r['steps_per_s']:.0f}", f"{r['steps_per_s'] * batch:.0f}"]
            print(row([batch, *rates, *latency_cells(r)]))
    finally:
        actor.close()


if __name__ == "__main__":
    main()
