"""`pagedserve bench serve`'s client alone: its CPU time per server-sent event.

A stand-in server in its own process (raw asyncio, one chunked SSE stream per request, shaped
like a completions stream with a final usage chunk) sends every open stream one event each
`--step-ms` (as a server sends one per engine step), `--tokens` events each. This process runs
`bench_serve.run` against it with `--streams` requests at once and reads its own CPU time
(`resource.getrusage`): the client's cost per event, whoever else runs on the machine.

    python scripts/profile/bench_client.py --streams 256 --tokens 64 --step-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import resource
import socket
import time

import anyio
from harness import row

from pagedserve.api import bench, bench_serve

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
EVENT = b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":'
EVENT += b'[{"index":0,"text":" to","logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class StreamingServer(asyncio.Protocol):
    """Answers one request per connection with a stream fed by `Stepper`."""

    def __init__(self, streams: list[StreamingServer]) -> None:
        self.streams, self.sent, self.request = streams, -1, b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.request += data
        head, _, body = self.request.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        if self.sent < 0 and len(body) >= length:
            self.transport.write(HEAD)  # type: ignore[attr-defined]
            self.sent = 0
            self.streams.append(self)

    def step(self, tokens: int) -> bool:
        """One more event; True when the stream has ended."""
        self.sent += 1
        data = chunk(EVENT)
        if self.sent == tokens:
            usage = b'{"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":'
            data += chunk(b"data: " + usage + b"%d}}\n\n" % tokens)
            data += chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        self.transport.write(data)  # type: ignore[attr-defined]
        return self.sent == tokens


def serve(listener: socket.socket, tokens: int, step_s: float) -> None:
    async def main() -> None:
        streams: list[StreamingServer] = []
        loop = asyncio.get_running_loop()
        await loop.create_server(lambda: StreamingServer(streams), sock=listener)
        while True:
            await asyncio.sleep(step_s)
            streams[:] = [s for s in streams if not s.step(tokens)]

    asyncio.run(main())


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=10.0)
    args = parser.parse_args()
    listener = socket.create_server(("127.0.0.1", 0))
    base = f"http://127.0.0.1:{listener.getsockname()[1]}"
    server = multiprocessing.Process(
        target=serve, args=(listener, args.tokens, args.step_ms / 1000), daemon=True
    )
    server.start()
    try:
        workload = bench.random_workload(args.streams, (4, 4), (args.tokens, args.tokens), 100)
        before, start = own_cpu(), time.perf_counter()
        result = anyio.run(bench_serve.run, base, "m", workload, float("inf"))
        cpu, elapsed = own_cpu() - before, time.perf_counter() - start
    finally:
        server.kill()
        server.join()
    events = args.streams * args.tokens
    print(row(["streams", "events", "completed", "events/s", "client busy %", "CPU µs / event",
               "ITL p50 / p99 ms"]))  # fmt: skip
    print(row(["---:"] * 7))
    itl = result["itl"]
    print(row([args.streams, events, result["completed"], f"{events / elapsed:.0f}",
               f"{100 * cpu / elapsed:.0f}", f"{1e6 * cpu / events:.1f}",
               f"{itl['median_ms']:.1f} / {itl['p99_ms']:.1f}"]))  # fmt: skip


if __name__ == "__main__":
    main()
