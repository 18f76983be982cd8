"""API server alone: HTTP requests per second and latency against an instant engine.

The API server actor runs as in the engine (uvicorn, the async ZeroMQ client, CURVE); the
profiler is the engine: it binds the tokenizer's and the detokenizer's ROUTERs, answers Hello
and Ping, and answers every GenerateRequest at once with one final delta of `--tokens` tokens.
So the figures are the HTTP server's own cost: parsing, the client, rendering, SSE.

    python scripts/profile/api_server.py --requests 2000 --concurrency 1 32
"""

from __future__ import annotations

import argparse
import socket
import time

import anyio
import httpx
from harness import SoloActor, percentiles, row

from pagedserve.actors import bus
from pagedserve.actors.messages import (
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
from pagedserve.config import EngineConfig, ServerConfig


async def fake_engine(actor: SoloActor, tokens: int) -> None:
    ctx = actor.peer_context()
    requests: bus.Router = bus.Router(ctx, actor.addresses.requests, ClientRequests)
    outputs: bus.Router = bus.Router(ctx, actor.addresses.outputs, ClientControl)

    async def control() -> None:
        while True:
            identity, message = await outputs.recv()
            await outputs.send(identity, Welcome(0) if isinstance(message, Hello) else Pong(0))

    async def generate() -> None:
        while True:
            identity, message = await requests.recv()
            if isinstance(message, GenerateRequest):
                delta = RequestDelta(
                    seq=message.seq, text=" to" * tokens, token_ids=[5] * tokens,
                    finish_reason=FinishReason.LENGTH, prompt_token_ids=[1, 2, 3],
                )  # fmt: skip
                await outputs.send(identity, DeltaBatch([delta]))

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(control)
            await generate()
    finally:
        ctx.destroy(linger=0)


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
    args = parser.parse_args()
    port = free_port()
    actor = SoloActor("api-server", EngineConfig(server=ServerConfig(port=port)))
    try:
        print(row(["stream", "concurrency", "requests/s", "latency µs p50", "p90", "p99"]))
        print(row(["---:"] * 6))
        anyio.run(profile, actor, args, f"http://127.0.0.1:{port}")
    finally:
        actor.close()


if __name__ == "__main__":
    main()
