"""API server: its RSS after batches of one kind of request each (does any kind grow it?).

A supervisor with the HTTP server on the embedded model (the soak's settings); after a warm-up
of 200 streams, batches of `--requests` requests of each kind in `--kinds` (`stream`: read to
the end; `abandon`: the client leaves after two events, an abort; `full`: not streamed), 16 at
a time, the API server's RSS after each batch.

    python scripts/profile/api_server_memory.py --requests 1500 --kinds stream abandon full
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import anyio
import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from soak import free_port, prompt  # noqa: E402

from pagedserve.actors.supervisor import Supervisor  # noqa: E402
from pagedserve.config import EngineConfig, ServerConfig  # noqa: E402

CONCURRENCY = 16


async def one(http: httpx.AsyncClient, rng: random.Random, kind: str) -> None:
    body = {
        "model": "pagedserve/tiny-shakespeare", "max_tokens": rng.randint(4, 32),
        "prompt": prompt(rng), "stream": kind != "full",
    }  # fmt: skip
    if kind == "full":
        reply = await http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        return
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        events = 0
        async for line in reply.aiter_lines():
            events += line.startswith("data: ")
            if kind == "abandon" and events >= 2:
                return


async def batch(base_url: str, kind: str, num: int) -> None:
    rng, limit = random.Random(0), anyio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as http:

        async def run() -> None:
            async with limit:
                await one(http, rng, kind)

        async with anyio.create_task_group() as tg:
            for _ in range(num):
                tg.start_soon(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--kinds", nargs="+", default=["stream", "abandon", "full"],
                        choices=["stream", "abandon", "full"])  # fmt: skip
    args = parser.parse_args()
    port = free_port()
    supervisor = Supervisor(EngineConfig(server=ServerConfig(port=port), num_kv_blocks=1024))
    supervisor.start(extra_actors=("api-server",))
    server = psutil.Process(supervisor.processes["api-server"].pid)
    base_url = f"http://127.0.0.1:{port}"
    try:
        anyio.run(batch, base_url, "stream", 200)
        print("| batch | requests | API server RSS MiB | seconds |\n|---|---:|---:|---:|")
        print(f"| warm-up (stream) | 200 | {server.memory_info().rss / 2**20:.2f} | |")
        for kind in args.kinds:
            start = time.monotonic()
            anyio.run(batch, base_url, kind, args.requests)
            time.sleep(1.5)  # aborted requests' last frames
            rss = server.memory_info().rss / 2**20
            print(f"| {kind} | {args.requests} | {rss:.2f} | {time.monotonic() - start:.0f} |")
    finally:
        supervisor.stop()


if __name__ == "__main__":
    main()
