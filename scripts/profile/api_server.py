"""API server alone: HTTP requests per second and latency against an instant engine.

The API server actor runs as in the engine (uvicorn, the async ZeroMQ client, CURVE); the
profiler is the engine: it binds the tokenizer's and the detokenizer's ROUTERs, answers Hello
and Ping, and answers every GenerateRequest at once with one final delta of `--tokens` tokens.
So the figures are the HTTP server's own cost: parsing, the client, rendering, SSE. (The
server's client does not wait for its Welcome, so its first request may come before its Hello:
the profiler answers requests once the Hello came, as a frame to a DEALER the ROUTER has not
seen yet is dropped.)

`--streams S` measures the streaming output path instead: S streamed completions at once, the
profiler's engine sending one DeltaBatch of a token for every live stream each `--step-ms`
(as the detokenizer sends one per engine step), `--tokens` tokens each; it reports the API
server process's CPU time (psutil) per token and how many SSE events carried them (a server
that falls behind merges a stream's waiting deltas into one event).

    python scripts/profile/api_server.py --requests 2000 --concurrency 1 32
    python scripts/profile/api_server.py --streams 256 --tokens 64 --step-ms 10
"""

from __future__ import annotations

import argparse
import socket
import time

import anyio
import httpx
import msgspec
import psutil
from harness import SoloActor, percentiles, row

from pagedserve.actors import bus
from pagedserve.actors.messages import (
    AbortRequest,
    ClientControl,
    ClientRequests,
    DeltaBatch,
    FinishReason,
    GenerateRequest,
    Hello,
    Pong,
    RequestDelta,
    Welcome,
)
from pagedserve.api.sse_client import stream_events
from pagedserve.config import EngineConfig, ServerConfig


async def answer_control(outputs: bus.Router, greeted: anyio.Event) -> None:
    """Hello -> Welcome, Ping -> Pong; `greeted` is set once the server's client said Hello."""
    while True:
        identity, message = await outputs.recv()
        await outputs.send(identity, Welcome(0) if isinstance(message, Hello) else Pong(0))
        greeted.set()


async def fake_engine(actor: SoloActor, tokens: int) -> None:
    ctx = actor.peer_context()
    requests: bus.Router = bus.Router(ctx, actor.addresses.requests, ClientRequests)
    outputs: bus.Router = bus.Router(ctx, actor.addresses.outputs, ClientControl)
    greeted = anyio.Event()

    async def generate() -> None:
        while True:
            identity, message = await requests.recv()
            await greeted.wait()
            if isinstance(message, GenerateRequest):
                delta = RequestDelta(
                    seq=message.seq, text=" to" * tokens, token_ids=[5] * tokens,
                    finish_reason=FinishReason.LENGTH, prompt_token_ids=[1, 2, 3],
                )  # fmt: skip
                await outputs.send(identity, DeltaBatch([delta]))

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(answer_control, outputs, greeted)
            await generate()
    finally:
        ctx.destroy(linger=0)


async def streaming_engine(actor: SoloActor, tokens: int, step_s: float) -> None:
    """Streams `tokens` tokens to every request: one DeltaBatch per client each step."""
    ctx = actor.peer_context()
    requests: bus.Router = bus.Router(ctx, actor.addresses.requests, ClientRequests)
    outputs: bus.Router = bus.Router(ctx, actor.addresses.outputs, ClientControl)
    live: dict[tuple[bytes, int], int] = {}  # route -> tokens sent
    greeted = anyio.Event()

    async def admit() -> None:
        while True:
            identity, message = await requests.recv()
            if isinstance(message, GenerateRequest):
                live[(identity, message.seq)] = 0
            elif isinstance(message, AbortRequest):
                for seq in message.seqs:
                    live.pop((identity, seq), None)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(answer_control, outputs, greeted)
            tg.start_soon(admit)
            await greeted.wait()
            while True:
                await anyio.sleep(step_s)
                await step(outputs, live, tokens)
    finally:
        ctx.destroy(linger=0)


async def step(outputs: bus.Router, live: dict[tuple[bytes, int], int], tokens: int) -> None:
    batches: dict[bytes, list[RequestDelta]] = {}
    for (identity, seq), sent in list(live.items()):
        final = sent + 1 == tokens
        delta = RequestDelta(
            seq=seq, text=" to", token_ids=[5], token_offset=sent, text_offset=3 * sent,
            finish_reason=FinishReason.LENGTH if final else None,
            prompt_token_ids=[1, 2, 3] if sent == 0 else None,
        )  # fmt: skip
        batches.setdefault(identity, []).append(delta)
        live[(identity, seq)] = sent + 1
        if final:
            del live[(identity, seq)]
    for identity, deltas in batches.items():
        await outputs.send(identity, DeltaBatch(deltas))


async def follow_streams(url: str, streams: int, tokens: int) -> tuple[int, int]:
    """`streams` streamed completions at once; (events with a choice, streams completed)."""
    body = msgspec.json.encode({"prompt": "To be", "max_tokens": tokens, "stream": True})
    counts = [0, 0]

    def count(events: list[bytes]) -> None:
        counts[1] += b"[DONE]" in events
        counts[0] += sum(bool(msgspec.json.decode(e)["choices"]) for e in events if e[0] == 123)

    async def one() -> None:
        await stream_events(url + "/v1/completions", body, count)

    async with anyio.create_task_group() as tg:
        for _ in range(streams):
            tg.start_soon(one)
    return counts[0], counts[1]


async def profile_streams(actor: SoloActor, args: argparse.Namespace, url: str) -> None:
    server = psutil.Process(actor.ready.pid)
    async with anyio.create_task_group() as tg:
        tg.start_soon(streaming_engine, actor, args.tokens, args.step_ms / 1000)
        await follow_streams(url, 8, 4)  # warm-up
        before, start = server.cpu_times(), time.perf_counter()
        events, done = await follow_streams(url, args.streams, args.tokens)
        after, elapsed = server.cpu_times(), time.perf_counter() - start
        tg.cancel_scope.cancel()
    cpu = (after.user + after.system) - (before.user + before.system)
    tokens = args.streams * args.tokens
    print(row(["streams", "tokens", "events", "completed", "tok/s", "server busy %",
               "server CPU µs / token", "µs / event"]))  # fmt: skip
    print(row(["---:"] * 8))
    print(row([args.streams, tokens, events, done, f"{tokens / elapsed:.0f}",
               f"{100 * cpu / elapsed:.0f}", f"{1e6 * cpu / tokens:.1f}",
               f"{1e6 * cpu / max(events, 1):.1f}"]))  # fmt: skip


async def load(url: str, requests: int, concurrency: int, stream: bool) -> dict[str, float]:
    body = {"prompt": "To be", "max_tokens": 8, "stream": stream}
    samples: list[float] = []
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:

        async def one() -> None:
            start = time.perf_counter()
            reply = await http.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            samples.append(time.perf_counter() - start)

        async def lane(count: int) -> None:
            for _ in range(count):
                await one()

        for _ in range(20):  # warm-up
            await one()
        samples.clear()
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(concurrency):
                tg.start_soon(lane, requests // concurrency + (i < requests % concurrency))
        elapsed = time.perf_counter() - start
    return {"requests_per_s": requests / elapsed, **percentiles(samples)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def profile(actor: SoloActor, args: argparse.Namespace, url: str) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(fake_engine, actor, args.tokens)
        for stream in (False, True):
            for concurrency in args.concurrency:
                r = await load(url, args.requests, concurrency, stream)
                print(row([stream, concurrency, f"{r['requests_per_s']:.0f}", f"{r['p50_us']:.0f}",
                           f"{r['p90_us']:.0f}", f"{r['p99_us']:.0f}"]), flush=True)  # fmt: skip
        tg.cancel_scope.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--streams", type=int, default=0, help="streaming mode: this many")
    parser.add_argument("--step-ms", type=float, default=10.0, help="streaming mode's step")
    args = parser.parse_args()
    port = free_port()
    config = ServerConfig(port=port, disable_log_requests=True)
    actor = SoloActor("api-server", EngineConfig(server=config))
    url = f"http://127.0.0.1:{port}"
    try:
        if args.streams:
            anyio.run(profile_streams, actor, args, url)
            return
        print(row(["stream", "concurrency", "requests/s", "latency µs p50", "p90", "p99"]))
        print(row(["---:"] * 6))
        anyio.run(profile, actor, args, url)
    finally:
        actor.close()


if __name__ == "__main__":
    main()
