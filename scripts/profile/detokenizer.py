"""Detokenizer alone: engine steps per second and latency with N streams, tokens in to text out.

The detokenizer actor runs as in the engine; the profiler is its scheduler (a PUSH to its
inbox: one EngineOutputs with N routes, then one frame a step with a token for every stream)
and its client (a DEALER to its ROUTER, which receives one DeltaBatch a step). Besides the
latency of a step it reports the actor process's CPU time per token (psutil): what a token
costs there whoever else runs on the machine.

Each stream gets the same token each step, ids 100-299 in turn (in the embedded model's
byte-level vocabulary a quarter of them are lead bytes of characters split across tokens),
or with `--text` the tokens of an English passage in turn (whole words: the common case).

    python scripts/profile/detokenizer.py --streams 1 64 256 --steps 500 [--stop zzzz] [--text]
"""

from __future__ import annotations

import argparse
import os
import time

import anyio
import psutil
import tokenizers
from harness import SoloActor, encode, latency_cells, percentiles, row

from pagedserve.actors import bus
from pagedserve.actors.messages import (
    DetokenizerInbound,
    EngineOutputs,
    Hello,
    RequestOutput,
    Route,
    SamplingParams,
)
from pagedserve.config import EngineConfig

IDENTITY = b"profile-client"
TEXT = (
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles"
)


def token_ids(config: EngineConfig, text: bool) -> list[int]:
    """The tokens every stream gets in turn: ids 100-299, or (`text`) those of TEXT."""
    if not text:
        return list(range(100, 300))
    path = os.path.join(config.resolve().tokenizer_path, "tokenizer.json")
    return tokenizers.Tokenizer.from_file(path).encode(TEXT).ids


async def measure(
    actor: SoloActor, streams: int, steps: int, stop: list[str], tokens: list[int]
) -> dict[str, float]:
    ctx = actor.peer_context()
    scheduler: bus.Sender[DetokenizerInbound] = bus.Sender(ctx, actor.addresses.detokenizer_inbox)
    client = bus.dealer_socket(ctx, actor.addresses.outputs, IDENTITY)
    await client.send(encode(Hello()))
    await client.recv()  # Welcome: the ROUTER knows this client now
    sampling = SamplingParams(max_tokens=steps + 1, stop=stop)
    handles = list(range(streams))
    routes = [Route(h, IDENTITY, h, [10, 11, 12], sampling, []) for h in handles]
    await scheduler.send(EngineOutputs(routes=routes))
    samples = []
    process = psutil.Process(actor.ready.pid)
    cpu_before = sum(process.cpu_times()[:2])
    start = time.perf_counter()
    for step in range(steps):
        token = tokens[step % len(tokens)]
        outputs = [RequestOutput(h, [token], None, None, None, 0, step) for h in handles]
        sent = time.perf_counter()
        await scheduler.send(EngineOutputs(outputs=outputs))
        await client.recv()
        samples.append(time.perf_counter() - sent)
    elapsed = time.perf_counter() - start
    cpu = sum(process.cpu_times()[:2]) - cpu_before
    ctx.destroy(linger=0)
    return {"steps_per_s": steps / elapsed, "tokens_per_s": steps * streams / elapsed,
            "cpu_us_per_token": 1e6 * cpu / (steps * streams), **percentiles(samples)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=500)
    stop_help = "stop strings of every stream, none in its text (a stopped stream sends no more)"
    parser.add_argument("--stop", nargs="*", default=[], help=stop_help)
    parser.add_argument("--text", action="store_true", help="an English passage's tokens")
    args = parser.parse_args()
    config = EngineConfig()
    tokens = token_ids(config, args.text)
    actor = SoloActor("detokenizer", config)
    try:
        print(row(["streams", "steps/s", "tokens/s", "CPU µs / token", "step latency µs p50",
                   "p90", "p99"]))  # fmt: skip
        print(row(["---:"] * 7))
        for streams in args.streams:
            r = anyio.run(measure, actor, streams, args.steps, args.stop, tokens)
            rates = [f"{r['steps_per_s']:.0f}", f"{r['tokens_per_s']:.0f}"]
            print(row([streams, *rates, f"{r['cpu_us_per_token']:.1f}", *latency_cells(r)]))
    finally:
        actor.close()


if __name__ == "__main__":
    main()
