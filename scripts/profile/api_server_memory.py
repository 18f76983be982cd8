"""API server: its RSS after batches of one kind of request each (does any kind grow it?).

A supervisor with the HTTP server on the embedded model (the soak's settings); after a warm-up
of 200 streams, batches of `--requests` requests of each kind in `--kinds` (`stream`: read to
the end; `abandon`: the client leaves after two events, an abort; `full`: not streamed), 16 at
a time, the API server's RSS after each batch.

    python scripts/profile/api_server_memory.py --requests 1500 --kinds stream abandon full

`--heap-trim-interval-s 0` turns the server's periodic malloc_trim off (the code before it).
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


def rss_breakdown(pid: int) -> dict[str, float]:
    """Resident MiB by mapping (/proc/PID/smaps): glibc's main heap (`[heap]`, and its size),
    anonymous mappings (pymalloc's arenas, other malloc arenas, mmapped chunks, stacks), files."""
    rss: dict[str, int] = {"heap": 0, "heap_size": 0, "anon": 0, "file": 0, "other": 0}
    kind = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if not fields[0].endswith(":"):  # a mapping: range perms offset dev inode [path]
            path = fields[5] if len(fields) > 5 else ""
            kind = "heap" if path == "[heap]" else "other" if path.startswith("[") else (
                "file" if path else "anon")  # fmt: skip
        elif fields[0] == "Rss:":
            rss[kind] += int(fields[1]) << 10
        elif fields[0] == "Size:" and kind == "heap":
            rss["heap_size"] += int(fields[1]) << 10
    return {name: value / 2**20 for name, value in rss.items()}


def breakdown_cells(pid: int) -> str:
    parts = rss_breakdown(pid)
    return (f"{parts['heap']:.2f} of {parts['heap_size']:.2f} | {parts['anon']:.2f} | "
            f"{parts['file']:.2f}")  # fmt: skip


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
    parser.add_argument("--heap-trim-interval-s", type=float,
                        default=ServerConfig().heap_trim_interval_s)  # fmt: skip
    args = parser.parse_args()
    port = free_port()
    server_config = ServerConfig(port=port, heap_trim_interval_s=args.heap_trim_interval_s)
    supervisor = Supervisor(EngineConfig(server=server_config, num_kv_blocks=1024))
    supervisor.start(extra_actors=("api-server",))
    server = psutil.Process(supervisor.processes["api-server"].pid)
    base_url = f"http://127.0.0.1:{port}"
    try:
        anyio.run(batch, base_url, "stream", 200)
        print("| batch | requests | API server RSS MiB | [heap] resident of size | anon | "
              "files | seconds |\n|---|---:|---:|---:|---:|---:|---:|")  # fmt: skip
        rss = server.memory_info().rss / 2**20
        print(f"| warm-up (stream) | 200 | {rss:.2f} | {breakdown_cells(server.pid)} | |")
        for kind in args.kinds:
            start = time.monotonic()
            anyio.run(batch, base_url, kind, args.requests)
            time.sleep(1.5)  # aborted requests' last frames
            rss = server.memory_info().rss / 2**20
            cells = breakdown_cells(server.pid)
            seconds = time.monotonic() - start
            print(f"| {kind} | {args.requests} | {rss:.2f} | {cells} | {seconds:.0f} |")
    finally:
        supervisor.stop()


if __name__ == "__main__":
    main()
