"""Bus alone: round trip of a real step plan over the actors' channels, between two processes.

The driver plays the scheduler: a real `Scheduler` holds N running requests in decode, and each
round trip it schedules the next step (the plan the engine sends: the flat columnar diff of N
requests the worker holds), encodes it once and sends the frame, as the scheduler actor's
`broadcast` does; its inbox polls first, as the scheduler's. The echo process plays worker
rank 0: its inbox is the worker's (it connects, and polls first), it decodes the plan and
answers the StepResult the model runner builds for a decode step (the scheduled handles, one
token each), which the driver decodes. Timed: from the plan's encode to the result decoded;
not timed: the scheduler making the plan and applying the result (scheduler.py profiles them).

Variants, run in interleaved rounds so that a busy machine disturbs them alike:
  bus               the engine's channels (bus.py), as the actors set them up
  bus-worker-waits  the same, but the worker's inbox waits on the loop without polling first
  bus-spin          the engine's channels with both inboxes checked in a loop for up to
                    BUS_SPIN_US before they poll (the engine's default on a GPU machine of
                    8 CPUs or more: EngineConfig.bus_spin_us)
  floor             the same bytes ping-ponged by plain synchronous ZeroMQ sockets, with no
                    Python work but send and receive: what the machine and ZeroMQ cost
  floor-paced       the same, but between two round trips the driver does the scheduler's
                    untimed work (its next plan, the result applied), as the bus rows do: an
                    idle CPU that waited that long wakes more slowly (on a VM whose guest does
                    not poll before it halts, `haltpoll.guest_halt_poll_ns=0`, the host's own
                    halt polling ends after ~200 µs)
  floor-paced-spin  floor-paced with both ends polling in a loop instead of sleeping in the
                    kernel: what busy waiting (one CPU each) would buy
`--auth` picks how the sockets authenticate, a row each: `plain` (the engine's way on ipc: the
run's password in the handshake only), `curve` (every frame encrypted and authenticated, as the
engine's ipc sockets did before session 34; tcp sockets still do), `none`.
`--reply-delay-ms D` makes the echo sleep D ms before each answer (a step on the device): the
row's round trip is then the time beyond D, and an inbox whose poll (`--poll-first-ms`, the
engine's bus.POLL_FIRST_S by default; one row each) is shorter than D waits on the loop.
`--cpus D E` pins the driver's process (its threads, ZeroMQ's I/O thread among them) to CPU D
and the echo's to CPU E before either makes a socket: `0 0` shares one CPU, `0 1` gives each
its own; without it the kernel places them.

    python scripts/profile/bus.py --decodes 256 --iterations 3000 [--cpus 0 1]
        [--reply-delay-ms 8 --poll-first-ms 5 50]
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
import numpy as np
import zmq
from harness import latency_cells, percentiles, row

from pagedserve.actors import bus, security
from pagedserve.actors.addresses import Addresses
from pagedserve.actors.messages import (
    AddRequest,
    SamplingParams,
    SchedulerInbound,
    Shutdown,
    StepPlan,
    StepResult,
    WorkerInbound,
)
from pagedserve.actors.scheduler.scheduler import Scheduler
from pagedserve.actors.security import Credentials
from pagedserve.config import BUS_SPIN_US, EngineConfig

AUTHS = ("plain", "curve", "none")
WARM_UP = 200  # round trips not counted: connections, allocations
PROMPT_LEN = 20
BLOCK_SIZE = 16
VARIANTS = ("bus", "bus-worker-waits", "bus-spin", "floor", "floor-paced", "floor-paced-spin")
SAMPLED = 7 + np.arange(4096, dtype=np.int64) % 50  # the tokens a step samples


def decoding_scheduler(decodes: int, steps: int, epoch: int) -> Scheduler:
    """A scheduler of this epoch whose next `steps` plans are decodes of `decodes` running
    requests (the first plan, their prefill, is taken here)."""
    max_len = PROMPT_LEN + steps + 2
    config = EngineConfig(
        block_size=BLOCK_SIZE, max_model_len=max_len, max_num_seqs=decodes,
        max_num_batched_tokens=max(decodes * PROMPT_LEN, 2048), max_waiting_requests=decodes,
    )  # fmt: skip
    scheduler = Scheduler(config, decodes * (-(-max_len // BLOCK_SIZE)), epoch)
    sampling = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    for seq in range(decodes):
        prompt = [2 + (seq + i) % 50 for i in range(PROMPT_LEN)]
        scheduler.add_request(AddRequest(client=b"bus", seq=seq, prompt_token_ids=prompt,
                                         sampling=sampling, eos_token_ids=[1]))  # fmt: skip
    prefill = scheduler.schedule()
    assert prefill is not None and len(prefill.new_requests) == decodes
    scheduler.update_from_result(worker_result(prefill))
    return scheduler


def worker_result(plan: StepPlan) -> StepResult:
    """What worker rank 0 answers for a step where every scheduled request samples a token
    (its tokens come from the device as one array: `tolist()`)."""
    tokens = SAMPLED[: len(plan.scheduled)].tolist()
    return StepResult(step_id=plan.step_id, handles=plan.scheduled, sampled_token_ids=tokens)


async def echo(run_dir: str, credentials: Credentials | None, poll_first_s: float,
               delay_s: float, spin_s: float) -> None:  # fmt: skip
    addresses = Addresses(run_dir)
    ctx = bus.async_context(credentials)
    inbox: bus.Receiver = bus.Receiver(ctx, addresses.worker_inbox(0), WorkerInbound, bind=False,
                                       poll_first_s=poll_first_s, spin_s=spin_s)  # fmt: skip
    out: bus.Sender = bus.Sender(ctx, addresses.scheduler_inbox)
    while not isinstance(plan := await inbox.recv(), Shutdown):
        if delay_s:  # the step on the device: the worker's loop waits with it
            time.sleep(delay_s)  # (a sleep of 0 would yield the CPU: not the engine's way)
        await out.send(worker_result(plan))
    ctx.destroy(linger=0)


async def drive(run_dir: str, credentials: Credentials | None, decodes: int, n: int,
                epoch: int, poll_first_s: float, delay_s: float, spin_s: float
                ) -> list[float]:  # fmt: skip
    scheduler = decoding_scheduler(decodes, n + WARM_UP, epoch)
    addresses = Addresses(run_dir)
    ctx = bus.async_context(credentials)
    inbox: bus.Receiver = bus.Receiver(ctx, addresses.scheduler_inbox, SchedulerInbound,
                                       poll_first_s=poll_first_s, spin_s=spin_s)  # fmt: skip
    out: bus.Sender = bus.Sender(ctx, addresses.worker_inbox(0), bind=True)
    samples = []
    for i in range(n + WARM_UP):
        plan = scheduler.schedule()
        assert plan is not None and len(plan.scheduled) == decodes and not plan.new_requests
        start = time.perf_counter()
        await out.send_frame(bus.encode(plan))
        result = await inbox.recv()
        if i >= WARM_UP:
            samples.append(time.perf_counter() - start - delay_s)
        assert isinstance(result, StepResult) and result.step_id == plan.step_id
        scheduler.update_from_result(result)
    await out.send(Shutdown())
    ctx.destroy(linger=0)
    return samples


ENGINE_USES_PLAIN = security.uses_plain


def use_mechanism(auth: str) -> None:
    """Make this process's engine channels speak `auth`'s mechanism: `curve` on ipc too
    (security.uses_plain picks the mechanism by address), else the engine's choice."""
    security.uses_plain = (lambda address: False) if auth == "curve" else ENGINE_USES_PLAIN


def floor_socket(ctx: zmq.Context, kind: int, address: str, bind: bool,
                 keys: Credentials | None) -> zmq.Socket:  # fmt: skip
    """A plain socket; with keys, secured as the engine's (security.secure: the mechanism
    use_mechanism picked, the binding end the server, checked by its process's ZAP handler)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        security.secure(sock, keys, server=bind, address=address)
    sock.bind(address) if bind else sock.connect(address)
    return sock


def typical_frames(decodes: int, epoch: int) -> tuple[bytes, bytes]:
    """A decode plan of the scheduler and its result, encoded."""
    scheduler = decoding_scheduler(decodes, 2, epoch)
    plan = scheduler.schedule()
    assert plan is not None
    return bus.encode(plan), bus.encode(worker_result(plan))


def floor(run_dir: str, keys: Credentials | None, role: str, decodes: int, n: int,
          epoch: int, delay_s: float, variant: str = "floor") -> list[float]:  # fmt: skip
    """The same frames by synchronous sockets: `role` "echo" answers, "drive" times; the
    paced variants plan and apply each step untimed between round trips (module doc)."""
    addresses, ctx, drives = Addresses(run_dir), zmq.Context(), role == "drive"
    authenticator = security.start_authenticator(ctx, keys) if keys and drives else None
    plans = floor_socket(
        ctx, zmq.PUSH if drives else zmq.PULL, addresses.worker_inbox(0), drives, keys
    )
    results = floor_socket(
        ctx, zmq.PULL if drives else zmq.PUSH, addresses.scheduler_inbox, drives, keys
    )
    plan, result = typical_frames(decodes, epoch)
    spin = variant == "floor-paced-spin"
    paced = drives and variant != "floor"
    scheduler = decoding_scheduler(decodes, n + WARM_UP, epoch) if paced else None
    samples = []
    while not drives and len(receive(plans, spin)) > 1:
        if delay_s:
            time.sleep(delay_s)
        results.send(result)
    for i in range(n + WARM_UP if drives else 0):
        step = scheduler.schedule() if scheduler is not None else None
        if step is not None:  # the scheduler's work between two round trips, untimed
            plan = bus.encode(step)
        start = time.perf_counter()
        plans.send(plan)
        receive(results, spin)
        if i >= WARM_UP:
            samples.append(time.perf_counter() - start - delay_s)
        if scheduler is not None and step is not None:  # the echo's bytes are a typical result
            scheduler.update_from_result(worker_result(step))
    plans.send(b"x") if drives else None
    authenticator.stop() if authenticator is not None else None
    ctx.destroy(linger=0)
    return samples


def receive(sock: zmq.Socket, spin: bool) -> bytes:
    """The next frame: a blocking receive, or (spin) polling without sleeping until one is in."""
    while spin and not zmq.zmq_poll([(sock, zmq.POLLIN)], 0):
        pass
    return sock.recv()


def measure(variant: str, decodes: int, n: int, auth: str, epoch: int,
            echo_cpu: int | None, poll_ms: float, delay_ms: float) -> list[float]:  # fmt: skip
    run_dir = tempfile.mkdtemp(prefix="bus-profile-")
    command = [sys.executable, __file__, "--echo", run_dir, "--variants", variant]
    command += ["--auth", auth]
    use_mechanism(auth)
    credentials = None if auth == "none" else Credentials.generate()
    keys = msgspec.json.encode(credentials).decode() if credentials else ""
    command += ["--epoch", str(epoch), "--poll-first-ms", str(poll_ms)]
    command += ["--reply-delay-ms", str(delay_ms)]
    command += [] if echo_cpu is None else ["--cpus", str(echo_cpu), str(echo_cpu)]
    child = subprocess.Popen(command + ["--decodes", str(decodes)], stdin=subprocess.PIPE,
                             text=True)  # fmt: skip
    child.stdin.write(keys)  # type: ignore[union-attr]
    child.stdin.close()  # type: ignore[union-attr]
    try:
        if variant.startswith("floor"):
            return floor(run_dir, credentials, "drive", decodes, n, epoch, delay_ms / 1e3,
                         variant)  # fmt: skip
        return anyio.run(drive, run_dir, credentials, decodes, n, epoch, poll_ms / 1e3,
                         delay_ms / 1e3, spin_of(variant))  # fmt: skip
    finally:
        child.wait(30)


def spin_of(variant: str) -> float:
    """The inboxes' spin of a bus variant (none but bus-spin's)."""
    return BUS_SPIN_US / 1e6 if variant == "bus-spin" else 0.0


def run_echo(args: argparse.Namespace) -> None:
    keys = sys.stdin.read()
    credentials = msgspec.json.decode(keys, type=Credentials) if keys else None
    variant, auth, delay_s = args.variants[0], args.auth[0], args.reply_delay_ms / 1e3
    use_mechanism(auth)
    if variant.startswith("floor"):
        floor(args.echo, credentials, "echo", args.decodes[0], 0, args.epoch, delay_s, variant)
    else:
        poll_first_s = 0.0 if variant == "bus-worker-waits" else args.poll_first_ms[0] / 1e3
        anyio.run(echo, args.echo, credentials, poll_first_s, delay_s, spin_of(variant))
    os.rmdir(args.echo) if not os.listdir(args.echo) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decodes", type=int, nargs="+", default=[256])
    parser.add_argument("--iterations", type=int, default=3000, help="per variant, all rounds")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--auth", nargs="+", choices=AUTHS, default=["plain"],
                        help="how the sockets authenticate, a row each (module doc)")  # fmt: skip
    parser.add_argument("--epoch", type=int, default=0,
                        help="the scheduler's (0: a fresh engine; from 1, after a restart, "
                        "handles and step ids are above 2**40 and take 9 bytes each)")  # fmt: skip
    parser.add_argument("--cpus", type=int, nargs=2, default=None, metavar=("DRIVER", "ECHO"),
                        help="pin the driver and the echo, each to one CPU")  # fmt: skip
    parser.add_argument("--reply-delay-ms", type=float, default=0.0,
                        help="the echo sleeps this long before each answer")  # fmt: skip
    parser.add_argument("--poll-first-ms", type=float, nargs="+",
                        default=[bus.POLL_FIRST_S * 1e3],
                        help="inbox polls to try, a row each")  # fmt: skip
    parser.add_argument("--echo", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cpus is not None:  # before any thread or socket: ZeroMQ's I/O thread inherits it
        os.sched_setaffinity(0, {args.cpus[1] if args.echo is not None else args.cpus[0]})
    if args.echo is not None:
        return run_echo(args)
    echo_cpu = None if args.cpus is None else args.cpus[1]
    print(f"reply delay {args.reply_delay_ms} ms (round trips are the time beyond it)\n")
    print("| decodes | auth | path | poll ms | plan bytes | result bytes | p50 µs each round "
          "| round trip µs p50 | p90 | p99 |")  # fmt: skip
    print("|---:|:---:|---|---:|---:|---:|---|---:|---:|---:|")
    for decodes in args.decodes:
        polls = {v: [0.0] if v.startswith("floor") else args.poll_first_ms for v in args.variants}
        cases = [(v, a, p) for a in args.auth for v in args.variants for p in polls[v]]
        samples: dict[tuple[str, str, float], list[list[float]]] = {c: [] for c in cases}
        for _ in range(args.rounds):
            for variant, auth, poll in cases:
                n = args.iterations // args.rounds
                samples[variant, auth, poll].append(measure(
                    variant, decodes, n, auth, args.epoch, echo_cpu, poll, args.reply_delay_ms
                ))  # fmt: skip
        plan, result = typical_frames(decodes, args.epoch)
        for (variant, auth, poll), rounds in samples.items():
            each = " / ".join(f"{percentiles(r)['p50_us']:.0f}" for r in rounds)
            pooled = percentiles([s for r in rounds for s in r])
            cells = [decodes, auth, variant, f"{poll:g}", len(plan),
                     len(result), each]  # fmt: skip
            print(row(cells + latency_cells(pooled)), flush=True)


if __name__ == "__main__":
    main()
