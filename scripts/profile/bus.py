"""Bus alone: round trip of a real step over the actors' channels, between two processes.

The driver (like the scheduler) sends a StepPlan of N decodes (N requests already in the
worker's batch: the columnar diff) on an asyncio PUSH channel; the echo process (like worker
rank 0) decodes it and answers a StepResult with one sampled token per request; the driver
decodes that. With CURVE (the engine's setting) and without, to show what security costs.

Each end builds its channels as its actor does: the driver's inbox polls first, like the
scheduler's (scheduler/actor.py POLL_FIRST_S); the echo's as the worker's (no poll first;
`--worker-poll-first` gives it the scheduler's, to show what that would change). The floor
rows are the same bytes ping-ponged by plain synchronous ZeroMQ sockets, with no Python work
but send and receive: what the machine and ZeroMQ cost (I/O threads, context switches).

    python scripts/profile/bus.py --decodes 256 --iterations 3000
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import anyio
import msgspec
import zmq
from harness import latency_cells, percentiles, row

from pagedserve.actors import bus
from pagedserve.actors.messages import (
    CachedRequestData,
    SchedulerInbound,
    StepPlan,
    StepResult,
    WorkerInbound,
)
from pagedserve.actors.scheduler.actor import POLL_FIRST_S
from pagedserve.actors.security import Credentials

WARM_UP = 200  # round trips not counted: connections, allocations


def decode_plan(step_id: int, decodes: int) -> StepPlan:
    handles = list(range(1 << 40, (1 << 40) + decodes))
    return StepPlan(
        step_id=step_id,
        cached_requests=CachedRequestData(handles, [[] for _ in handles], [300] * decodes),
        scheduled=handles,
        num_scheduled_tokens=[1] * decodes,
    )


def decode_result(plan: StepPlan) -> StepResult:
    return StepResult(
        step_id=plan.step_id, handles=plan.scheduled, sampled_token_ids=[7] * len(plan.scheduled)
    )


async def echo(run_dir: str, credentials: Credentials | None, poll_first_s: float) -> None:
    addresses = bus.Addresses(run_dir)
    ctx = bus.async_context(credentials)
    inbox: bus.Receiver = bus.Receiver(
        ctx, addresses.worker_inbox(0), WorkerInbound, bind=False, poll_first_s=poll_first_s
    )
    out: bus.Sender = bus.Sender(ctx, addresses.scheduler_inbox)
    while True:
        plan = await inbox.recv()
        if not plan.scheduled:
            break
        await out.send(decode_result(plan))
    ctx.destroy(linger=0)


async def drive(run_dir: str, credentials: Credentials | None, decodes: int, n: int) -> list[float]:
    addresses = bus.Addresses(run_dir)
    ctx = bus.async_context(credentials)
    inbox: bus.Receiver = bus.Receiver(
        ctx, addresses.scheduler_inbox, SchedulerInbound, poll_first_s=POLL_FIRST_S
    )
    out: bus.Sender = bus.Sender(ctx, addresses.worker_inbox(0), bind=True)
    samples = []
    for i in range(n + WARM_UP):
        start = time.perf_counter()
        await out.send(decode_plan(i, decodes))
        result = await inbox.recv()
        if i >= WARM_UP:
            samples.append(time.perf_counter() - start)
        assert result.step_id == i
    await out.send(StepPlan(step_id=-1))
    ctx.destroy(linger=0)
    return samples


def floor_socket(ctx: zmq.Context, kind: int, address: str, bind: bool,
                 keys: Credentials | None) -> zmq.Socket:  # fmt: skip
    """A plain socket; with keys, CURVE as the engine sets it (the binding end the server)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        if bind:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
        else:
            sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
    sock.bind(address) if bind else sock.connect(address)
    return sock


def floor(run_dir: str, keys: Credentials | None, role: str, decodes: int, n: int) -> list[float]:
    """The same frames by synchronous sockets: `role` "echo" answers, "drive" times."""
    addresses, ctx, drives = bus.Addresses(run_dir), zmq.Context(), role == "drive"
    plans = floor_socket(
        ctx, zmq.PUSH if drives else zmq.PULL, addresses.worker_inbox(0), drives, keys
    )
    results = floor_socket(
        ctx, zmq.PULL if drives else zmq.PUSH, addresses.scheduler_inbox, drives, keys
    )
    plan = bus.encode(decode_plan(0, decodes))
    result = bus.encode(decode_result(decode_plan(0, decodes)))
    samples = []
    while not drives and len(plans.recv()) > 1:
        results.send(result)
    for i in range(n + WARM_UP if drives else 0):
        start = time.perf_counter()
        plans.send(plan)
        results.recv()
        if i >= WARM_UP:
            samples.append(time.perf_counter() - start)
    plans.send(b"x") if drives else None
    ctx.destroy(linger=0)
    return samples


def measure(decodes: int, n: int, secure: bool, path: str, worker_poll_first: bool) -> dict:
    run_dir = tempfile.mkdtemp(prefix="bus-profile-")
    credentials = Credentials.generate() if secure else None
    keys = msgspec.json.encode(credentials).decode() if credentials else ""
    echo_args = ["--echo", run_dir, "--path", path, "--decodes", str(decodes)]
    echo_args += ["--worker-poll-first"] if worker_poll_first else []
    command = [sys.executable, __file__, *echo_args]
    child = subprocess.Popen(command, stdin=subprocess.PIPE, text=True)
    child.stdin.write(keys)  # type: ignore[union-attr]
    child.stdin.close()  # type: ignore[union-attr]
    try:
        if path == "floor":
            samples = floor(run_dir, credentials, "drive", decodes, n)
        else:
            samples = anyio.run(drive, run_dir, credentials, decodes, n)
    finally:
        child.wait(30)
    return {"plan_bytes": len(bus.encode(decode_plan(0, decodes)))} | percentiles(samples)


def run_echo(args: argparse.Namespace) -> None:
    keys = sys.stdin.read()
    credentials = msgspec.json.decode(keys, type=Credentials) if keys else None
    if args.path == "floor":
        floor(args.echo, credentials, "echo", args.decodes[0], 0)
    else:
        anyio.run(echo, args.echo, credentials, POLL_FIRST_S if args.worker_poll_first else 0.0)
    os.rmdir(args.echo) if not os.listdir(args.echo) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decodes", type=int, nargs="+", default=[256])
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--worker-poll-first", action="store_true")
    parser.add_argument("--echo", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--path", default="bus", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.echo is not None:
        return run_echo(args)
    print("| decodes | CURVE | path | plan bytes | round trip µs p50 | p90 | p99 |")
    print("|---:|:---:|---|---:|---:|---:|---:|")
    for decodes in args.decodes:
        for path in ("bus", "floor"):
            for secure in (True, False):
                r = measure(decodes, args.iterations, secure, path, args.worker_poll_first)
                label = "bus.py channels" if path == "bus" else "floor: sync zmq, same bytes"
                cells = [decodes, "yes" if secure else "no", label, r["plan_bytes"]]
                print(row(cells + latency_cells(r)), flush=True)


if __name__ == "__main__":
    main()
