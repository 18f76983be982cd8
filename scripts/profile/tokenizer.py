"""Tokenizer alone: requests per second and latency, request in to AddRequest out.

The tokenizer actor runs as in the engine (its own process, CURVE sockets); the profiler is
its client (a DEALER to its ROUTER) and its scheduler (the PULL end of the scheduler inbox).
Throughput: N requests sent at once; latency: one request at a time.

    python scripts/profile/tokenizer.py --requests 2000 --prompt-chars 100 1000
"""

from __future__ import annotations

import argparse
import random
import time

import anyio
from harness import SoloActor, dealer, encode, percentiles, row

from pagedserve.actors import bus
from pagedserve.actors.messages import GenerateRequest, SamplingParams, SchedulerInbound
from pagedserve.config import EngineConfig

WORDS = "to be or not that is the question whether tis nobler in the mind to suffer".split()


def text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    while sum(map(len, words)) + len(words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:chars]


async def measure(actor: SoloActor, requests: int, chars: int) -> dict[str, float]:
    ctx = actor.peer_context()
    scheduler: bus.Receiver = bus.Receiver(ctx, actor.addresses.scheduler_inbox, SchedulerInbound)
    client = dealer(ctx, actor.addresses.requests, "profile")
    rng, sampling = random.Random(0), SamplingParams(max_tokens=8)
    prompts = [text(rng, chars) for _ in range(requests)]
    latencies = []
    for seq in range(min(200, requests)):  # one at a time
        start = time.perf_counter()
        await client.send(encode(GenerateRequest(seq=seq, sampling=sampling, prompt=prompts[seq])))
        await scheduler.recv()
        latencies.append(time.perf_counter() - start)
    start = time.perf_counter()
    for seq in range(requests):  # all at once
        await client.send(encode(GenerateRequest(seq=seq, sampling=sampling, prompt=prompts[seq])))
    for _ in range(requests):
        await scheduler.recv()
    elapsed = time.perf_counter() - start
    ctx.destroy(linger=0)
    return {"requests_per_s": requests / elapsed, **percentiles(latencies)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--prompt-chars", type=int, nargs="+", default=[100, 1000])
    args = parser.parse_args()
    actor = SoloActor("tokenizer", EngineConfig())
    try:
        print(row(["prompt chars", "requests/s", "latency µs p50", "p90", "p99"]))
        print(row(["---:"] * 5))
        for chars in args.prompt_chars:
            r = anyio.run(measure, actor, args.requests, chars)
            print(row([chars, f"{r['requests_per_s']:.0f}", f"{r['p50_us']:.0f}",
                       f"{r['p90_us']:.0f}", f"{r['p99_us']:.0f}"]))  # fmt: skip
    finally:
        actor.close()


if __name__ == "__main__":
    main()
