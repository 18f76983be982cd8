"""Bus alone: round trip of a real step over the actors' channels, between two processes.

The driver (like the scheduler) sends a StepPlan of N decodes (N requests already in the
worker's batch: the columnar diff) on an asyncio PUSH channel; the echo process (like worker
rank 0) decodes it and answers a StepResult with one sampled token per request; the driver
decodes that. With CURVE (the engine's setting) and without, to show what security costs.

    python scripts/profile/bus.py --decodes 256 --iterations 3000
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import anyio
import msgspec

from pagedserve.actors import bus
from pagedserve.actors.messages import (
    CachedRequestData,
    SchedulerInbound,
    StepPlan,
    StepResult,
    WorkerInbound,
)
from pagedserve.actors.security import Credentials


def decode_plan(step_id: int, decodes: int) -> StepPlan:
    handles = list(range(1 << 40, (1 << 40) + decodes))
    return StepPlan(
        step_id=step_id,
        cached_requests=CachedRequestData(handles, [[] for _ in handles], [300] * decodes),
        scheduled=handles,
        num_scheduled_tokens=[1] * decodes,
    )


async def echo(run_dir: str, credentials: Credentials | None) -> None:
    addresses = bus.Addresses(run_dir)
    ctx = bus.async_context(credentials)
    inbox: bus.Receiver = bus.Receiver(ctx, addresses.worker_inbox(0), WorkerInbound, bind=False)
    out: bus.Sender = bus.Sender(ctx, addresses.scheduler_inbox)
    while True:
        plan = await inbox.recv()
        if not plan.scheduled:
            break
        await out.send(
            StepResult(step_id=plan.step_id, handles=plan.scheduled,
                       sampled_token_ids=[7] * len(plan.scheduled))
        )  # fmt: skip
    ctx.destroy(linger=0)


async def drive(run_dir: str, credentials: Credentials | None, decodes: int, n: int) -> list[float]:
    addresses = bus.Addresses(run_dir)
    ctx = bus.async_context(credentials)
    inbox: bus.Receiver = bus.Receiver(ctx, addresses.scheduler_inbox, SchedulerInbound)
    out: bus.Sender = bus.Sender(ctx, addresses.worker_inbox(0), bind=True)
    samples = []
    for i in range(n + 200):
        start = time.perf_counter()
        await out.send(decode_plan(i, decodes))
        result = await inbox.recv()
        if i >= 200:  # warm-up: connections, allocations
            samples.append(time.perf_counter() - start)
        assert result.step_id == i
    await out.send(StepPlan(step_id=-1))
    ctx.destroy(linger=0)
    return samples


def measure(decodes: int, n: int, secure: bool) -> dict[str, float]:
    run_dir = tempfile.mkdtemp(prefix="bus-profile-")
    credentials = Credentials.generate() if secure else None
    keys = msgspec.json.encode(credentials).decode() if credentials else ""
    child = subprocess.Popen(
        [sys.executable, __file__, "--echo", run_dir], stdin=subprocess.PIPE, text=True
    )
    child.stdin.write(keys)  # type: ignore[union-attr]
    child.stdin.close()  # type: ignore[union-attr]
    try:
        samples = anyio.run(drive, run_dir, credentials, decodes, n)
    finally:
        child.wait(30)
    plan_bytes = len(bus.encode(decode_plan(0, decodes)))
    return {
        "plan_bytes": plan_bytes,
        "p50_us": statistics.median(samples) * 1e6,
        "p90_us": sorted(samples)[int(0.9 * len(samples))] * 1e6,
        "p99_us": sorted(samples)[int(0.99 * len(samples))] * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decodes", type=int, nargs="+", default=[256])
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--echo", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.echo is not None:
        keys = sys.stdin.read()
        credentials = msgspec.json.decode(keys, type=Credentials) if keys else None
        anyio.run(echo, args.echo, credentials)
        os.rmdir(args.echo) if not os.listdir(args.echo) else None
        return
    print("| decodes | CURVE | plan bytes | round trip µs p50 | p90 | p99 |")
    print("|---:|:---:|---:|---:|---:|---:|")
    for decodes in args.decodes:
        for secure in (True, False):
            r = measure(decodes, args.iterations, secure)
            print(
                f"| {decodes} | {'yes' if secure else 'no'} | {r['plan_bytes']} | "
                f"{r['p50_us']:.0f} | {r['p90_us']:.0f} | {r['p99_us']:.0f} |"
            )


if __name__ == "__main__":
    main()
