"""API server memory under tracemalloc: what the server process keeps per request.

The engine runs in a supervisor (its own processes); the HTTP server (the API server actor's
`OpenAIServer` app on uvicorn, with its `AsyncClient`) runs in this process's event loop, so
tracemalloc and gc see exactly what it holds. The load comes from a separate process
(`api_server_memory.py`'s requests, 16 at a time), so nothing of the load generator is counted.
After a warm-up, batches of `--requests` requests of each kind; after each: gc, a tracemalloc
snapshot, the objects by type. Printed: traced growth per batch (bytes a request), the top
tracebacks of growth between the first and the last batch, the types whose counts grew.

    python scripts/profile/api_server_tracemalloc.py --requests 1000 --batches 3 --kind stream
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import os
import re
import socket
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import anyio
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from soak import free_port  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_server_memory import rss_breakdown  # noqa: E402

from pagedserve.actors.chat import load_tokenizer  # noqa: E402
from pagedserve.actors.supervisor import Supervisor  # noqa: E402
from pagedserve.api.client import AsyncClient  # noqa: E402
from pagedserve.api.openai_server import OpenAIServer, build_app  # noqa: E402
from pagedserve.api.sampling_defaults import sampling_defaults  # noqa: E402
from pagedserve.config import EngineConfig, ServerConfig  # noqa: E402

LOAD = """
import sys; sys.path.insert(0, {scripts!r}); sys.path.insert(0, {profile!r})
import anyio
from api_server_memory import batch
anyio.run(batch, {url!r}, {kind!r}, {num})
"""


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]  # fmt: skip


LIBC = ctypes.CDLL("libc.so.6")
LIBC.mallinfo2.restype = MallInfo2
LIBC.fopen.restype = ctypes.c_void_p
LIBC.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
LIBC.fclose.argtypes = [ctypes.c_void_p]
LIBC.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
HEAP = re.compile(
    r'<heap nr="(\d+)">.*?<total type="fast" count="\d+" size="(\d+)"/>\s*'
    r'<total type="rest" count="\d+" size="(\d+)"/>.*?<system type="current" size="(\d+)"/>',
    re.DOTALL,
)


def arenas_line() -> str:
    """glibc's arenas (malloc_info): each one's size and the free bytes in it, MiB."""
    with tempfile.NamedTemporaryFile(suffix=".xml") as out:
        handle = LIBC.fopen(out.name.encode(), b"w")
        LIBC.malloc_info(0, handle)
        LIBC.fclose(handle)
        xml = Path(out.name).read_text()
    cells = [
        f"#{nr} {int(size) / 2**20:.1f}/{(int(fast) + int(rest)) / 2**20:.1f} free"
        for nr, fast, rest, size in HEAP.findall(xml)
    ]
    return "glibc arenas: " + ", ".join(cells)


def memory_line() -> str:
    """RSS, glibc's heap (bytes in use, free in its arenas), pymalloc's arenas."""
    with open(f"/proc/{os.getpid()}/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    info = LIBC.mallinfo2()
    return (f"RSS {rss / 2**20:.2f} MiB, malloc heap {info.arena / 2**20:.2f} MiB, "
            f"in use {info.uordblks / 2**20:.2f} MiB, "
            f"malloc free {info.fordblks / 2**20:.2f} MiB, mmapped {info.hblkhd / 2**20:.2f} MiB, "
            f"{pymalloc_line()}\n    {arenas_line()}\n    {smaps_line()}")  # fmt: skip


def smaps_line() -> str:
    parts = rss_breakdown(os.getpid())
    return (f"[heap] {parts['heap']:.2f} of {parts['heap_size']:.2f} MiB resident, "
            f"anon {parts['anon']:.2f}, files {parts['file']:.2f}")  # fmt: skip


def pymalloc_line() -> str:
    """pymalloc's arenas now and the bytes in its allocated blocks (sys._debugmallocstats)."""
    with tempfile.TemporaryFile() as out:
        saved = os.dup(2)
        os.dup2(out.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        stats = {}
        for line in out.read().decode().splitlines():
            name, _, value = line.partition("=")
            if value.strip().replace(",", "").isdigit():
                stats[name.strip()] = int(value.strip().replace(",", ""))
    if "# arenas allocated current" not in stats:  # tracemalloc's hooks hide pymalloc's
        return "pymalloc: (no stats under tracemalloc)"
    arenas = stats["# arenas allocated current"]
    used = stats["# bytes in allocated blocks"]
    return f"pymalloc: {arenas} arenas ({arenas} MiB), {used / 2**20:.2f} MiB in blocks"


def type_counts() -> collections.Counter[str]:
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


async def drive(url: str, kind: str, num: int) -> None:
    here = Path(__file__).resolve().parent
    code = LOAD.format(scripts=str(here.parent), profile=str(here), url=url, kind=kind, num=num)
    await anyio.run_process([sys.executable, "-c", code], stdout=None, stderr=None)


def measure() -> tuple[tracemalloc.Snapshot, collections.Counter[str]]:
    gc.collect()
    print(memory_line(), flush=True)
    if not tracemalloc.is_tracing():
        return None, type_counts()
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)]
    )
    return snapshot, type_counts()


async def session(supervisor: Supervisor, listener: socket.socket, args) -> None:
    config = supervisor.sized_config
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    credentials = supervisor.credentials.for_clients()
    tokenizer = load_tokenizer(config.tokenizer_path, config.chat_template)
    async with AsyncClient(supervisor.addresses.engine_address, credentials=credentials) as client:
        handler = OpenAIServer(client, config, tokenizer, sampling_defaults(config))
        uv = uvicorn.Server(uvicorn.Config(build_app(handler), log_level="warning", lifespan="off"))
        async with anyio.create_task_group() as tg:
            tg.start_soon(uv.serve, [listener])
            await drive(url, args.kind, args.warmup)
            await anyio.sleep(1.5)
            snaps = [measure()]
            for _ in range(args.batches):
                await drive(url, args.kind, args.requests)
                await anyio.sleep(1.5)  # aborted requests' last frames
                snaps.append(measure())
                if args.trim_each_batch:
                    start = time.perf_counter()
                    LIBC.malloc_trim(0)
                    print(f"malloc_trim(0) {(time.perf_counter() - start) * 1e3:.1f} ms:",
                          memory_line())  # fmt: skip
                if len(snaps) > 3:  # keep the first two and the newest (each holds a Counter)
                    del snaps[2]
                print(f"pending in core: {len(client.core.requests)}, "
                      f"collectors: {len(client._collectors)}")  # fmt: skip
            uv.should_exit = True
    report(snaps, args)
    start = time.perf_counter()
    LIBC.malloc_trim(0)
    trim_ms = (time.perf_counter() - start) * 1e3
    print(f"after malloc_trim(0) ({trim_ms:.1f} ms):", memory_line())


def report(snaps: list, args) -> None:
    if snaps[0][0] is None:
        print("object types that grew:", (snaps[-1][1] - snaps[1][1]).most_common(25))
        return
    first, last = snaps[1], snaps[-1]  # after batch 1 (everything warm) and the last
    num = args.requests * (args.batches - 1)
    growth = sum(s.size for s in last[0].traces) - sum(s.size for s in first[0].traces)
    print(f"traced growth over the last {num} requests: {growth:+d} B ({growth / num:+.1f} B each)")
    print(f"\ntop tracebacks of growth over the last {num} requests:")
    for stat in last[0].compare_to(first[0], "traceback")[: args.top]:
        if stat.size_diff <= 0:
            continue
        print(f"{stat.size_diff:+d} B ({stat.count_diff:+d} blocks)")
        for line in stat.traceback.format()[-args.depth * 2 :]:
            print("   ", line)
    print("\nobject types that grew:")
    grown = last[1] - first[1]
    for name, count in grown.most_common(25):
        print(f"  {name}: +{count}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--kind", default="stream", choices=["stream", "abandon", "full"])
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--no-trace", action="store_true", help="RSS and gc only")
    parser.add_argument("--trim-each-batch", action="store_true", help="malloc_trim(0) after each")
    args = parser.parse_args()
    port = free_port()
    supervisor = Supervisor(EngineConfig(server=ServerConfig(port=port), num_kv_blocks=1024))
    supervisor.start()
    listener = supervisor.listener  # bound for the API server actor, which is not started
    assert listener is not None
    if not args.no_trace:
        tracemalloc.start(args.depth)
    try:
        anyio.run(session, supervisor, listener, args)
    finally:
        supervisor.stop()


if __name__ == "__main__":
    main()
