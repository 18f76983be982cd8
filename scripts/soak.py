"""Soak: mixed streaming load on the CPU for a fixed time; errors, memory, KV blocks.

A supervisor with the HTTP server on the embedded model, and `--concurrency` workers that loop
until `--seconds` have passed, each picking at random: an HTTP completion streamed or not, a
chat completion streamed, n > 1, a stop string, a ZeroMQ client stream, or a stream the client
abandons half way (an abort, not an error). Every request's outcome is checked (a 200 with
text, or a finished ZeroMQ stream). Each actor's resident memory is sampled every
`--sample-s`; growth is measured from the end of the warm-up to the end. At the end every KV
block must be free.

    python scripts/soak.py --seconds 600 --output scripts/results/soak_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import socket
import subprocess
import time
from dataclasses import dataclass, field

import anyio
import httpx
import psutil

from pagedserve import SamplingParams
from pagedserve.actors.supervisor import Supervisor
from pagedserve.api.client import AsyncClient, Client
from pagedserve.config import EngineConfig, ServerConfig

WORDS = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()


@dataclass
class Tally:
    ok: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def count(self, kind: str) -> None:
        self.ok[kind] = self.ok.get(kind, 0) + 1


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 60)))


async def http_request(http: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    kind = rng.choice(["stream", "full", "chat", "n3", "stop", "abandon"])
    body: dict = {"model": "pagedserve/tiny-shakespeare", "max_tokens": rng.randint(1, 64)}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt(rng)}]
        url, body["stream"] = "/v1/chat/completions", True
    else:
        body["prompt"], url = prompt(rng), "/v1/completions"
        body["stream"] = kind in ("stream", "stop", "abandon")
        body["n"] = 3 if kind == "n3" else 1
        if kind == "stop":
            body["stop"] = ["e"]
    if not body["stream"]:
        reply = await http.post(url, json=body)
        if reply.status_code != 200 or not reply.json()["choices"]:
            tally.errors.append(f"{kind}: {reply.status_code} {reply.text[:200]}")
            return
        tally.count(kind)
        return
    async with http.stream("POST", url, json=body) as reply:
        if reply.status_code != 200:
            tally.errors.append(f"{kind}: {reply.status_code}")
            return
        lines = 0
        async for line in reply.aiter_lines():
            lines += line.startswith("data: ")
            if kind == "abandon" and lines >= 2:
                tally.count(kind)
                return  # the connection closes: the server aborts the request
        if lines < 2:
            tally.errors.append(f"{kind}: a stream of {lines} events")
            return
    tally.count(kind)


async def zmq_request(client: AsyncClient, rng: random.Random, tally: Tally) -> None:
    params = SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(1, 64))
    finished = False
    async for delta in client.generate(prompt(rng), params):
        finished = delta.finish_reason is not None
    if not finished:
        tally.errors.append("zmq: no final delta")
        return
    tally.count("zmq")


async def load(base_url: str, address: str, args: argparse.Namespace, tally: Tally) -> None:
    deadline = time.monotonic() + args.seconds
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as http:
        async with AsyncClient(address) as client:

            async def worker(seed: int) -> None:
                rng = random.Random(seed)
                while time.monotonic() < deadline:
                    try:
                        if rng.random() < 0.25:
                            await zmq_request(client, rng, tally)
                        else:
                            await http_request(http, rng, tally)
                    except Exception as exc:  # every failure is counted, none stops the soak
                        tally.errors.append(f"{type(exc).__name__}: {exc}")

            async with anyio.create_task_group() as tg:
                for seed in range(args.concurrency):
                    tg.start_soon(worker, seed)


def sample_rss(supervisor: Supervisor) -> dict[str, int]:
    return {
        label: psutil.Process(process.pid).memory_info().rss
        for label, process in supervisor.processes.items()
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sample_forever(supervisor: Supervisor, args: argparse.Namespace, samples: list) -> None:
    start = time.monotonic()
    while time.monotonic() - start < args.seconds:
        time.sleep(args.sample_s)
        samples.append((time.monotonic() - start, sample_rss(supervisor)))


def report(args, supervisor, tally: Tally, samples: list, blocks: tuple[int, int]) -> str:
    warm = next(s for t, s in samples if t >= args.warmup_s)
    last = samples[-1][1]
    kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(tally.ok.items()))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    lines = [
        "# Soak: mixed streaming load on the CPU",
        "",
        f"- date: {datetime.date.today()}, machine: {platform.node()} "
        f"({os.cpu_count()} CPUs, {platform.processor() or platform.machine()}), commit {commit}",
        f"- command: `python scripts/soak.py --seconds {args.seconds} --concurrency "
        f"{args.concurrency} --warmup-s {args.warmup_s}`",
        f"- requests: {sum(tally.ok.values())} ok ({kinds}), errors: {len(tally.errors)}",
        f"- KV blocks free at the end: {blocks[0]} of {blocks[1]}",
        f"- restarts: {supervisor.restarts or 'none'}",
        "",
        f"| actor | RSS at {args.warmup_s:.0f} s (MiB) | RSS at end (MiB) | growth |",
        "|---|---:|---:|---:|",
    ]
    for label, rss in last.items():
        growth = 100.0 * (rss - warm[label]) / warm[label]
        lines.append(
            f"| {label} | {warm[label] / 2**20:.1f} | {rss / 2**20:.1f} | {growth:+.1f}% |"
        )
    lines += ["", "RSS (MiB) every sample:", "", "| t (s) | " + " | ".join(last) + " |",
              "|---:|" + "---:|" * len(last)]  # fmt: skip
    for t, sample in samples:
        lines.append(f"| {t:.0f} | " + " | ".join(f"{sample[k] / 2**20:.1f}" for k in last) + " |")
    if tally.errors:
        lines += ["", "Errors (first 20):", ""] + [f"- {e}" for e in tally.errors[:20]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmup-s", type=float, default=120)
    parser.add_argument("--sample-s", type=float, default=30)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    port = free_port()
    supervisor = Supervisor(EngineConfig(server=ServerConfig(port=port), num_kv_blocks=1024))
    supervisor.start(extra_actors=("api-server",))
    tally, samples = Tally(), [(0.0, sample_rss(supervisor))]
    try:
        address = supervisor.addresses.engine_address

        async def run() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, sample_forever, supervisor, args, samples)
                await load(f"http://127.0.0.1:{port}", address, args, tally)

        anyio.run(run)
        time.sleep(2.0)  # aborted requests' final steps
        with Client(address) as client:
            stats = client.stats()
        text = report(args, supervisor, tally, samples,
                      (stats.num_free_blocks, stats.num_total_blocks))  # fmt: skip
    finally:
        supervisor.stop()
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
