"""A lean streaming HTTP/1.1 client for `pagedserve bench serve`: POST a JSON body, read the
server-sent events of the response as they arrive.

A benchmark client must cost far less per event than the server it measures: one Python
process parses every event of 1,000 streams. httpx spends tens of microseconds per event (h11's
state machine for each HTTP chunk, several async-iterator layers, a line decoder). Here an
asyncio protocol parses each read from the socket (often many events at once) in its
`data_received`, into chunks and events with a few `bytes.find` calls, and hands them to a
callback: no task wakes up per read. It speaks just enough HTTP for that: one request per
connection, a chunked, sized or close-delimited body, no TLS, no redirects.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 1 << 16


class HTTPStatusError(Exception):
    """The server answered with a status other than 200."""


class ChunkedDecoder:
    """Transfer-Encoding: chunked, incrementally: bytes in, body bytes out."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.done = False

    def feed(self, data: bytes) -> bytes:
        buffer = self._buffer
        buffer += data
        pieces, position = [], 0
        while not self.done:
            line_end = buffer.find(b"\r\n", position)
            if line_end < 0:
                break
            size = int(bytes(buffer[position:line_end]).split(b";")[0], 16)
            end = line_end + 2 + size
            if len(buffer) < end + 2:
                break
            pieces.append(bytes(buffer[line_end + 2 : end]))
            position = end + 2
            self.done = size == 0
        del buffer[:position]
        return b"".join(pieces)


class EventSplitter:
    """Server-sent events: body bytes in, the `data:` payload of each complete event out."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[bytes]:
        events = (self._pending + data).replace(b"\r\n", b"\n").split(b"\n\n")
        self._pending = events.pop()
        payloads = []
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    payloads.append(line[5:].lstrip(b" "))
        return payloads


def _request(url: str, body: bytes) -> tuple[str, int, bytes]:
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise ValueError(f"the bench client speaks plain http://, not {url!r}")
    port = parts.port or 80
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    head = (
        f"POST {target} HTTP/1.1\r\nHost: {parts.hostname}:{port}\r\n"
        f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return parts.hostname, port, head.encode() + body


class EventStreamProtocol(asyncio.Protocol):
    """One response, parsed as its bytes arrive (no task wakes per read): the head, then the
    body's events, handed to `on_events` (a list per read) from `data_received` itself."""

    def __init__(self, on_events: Callable[[list[bytes]], None]) -> None:
        self.on_events = on_events
        self.finished = asyncio.get_running_loop().create_future()
        self._head = b""
        self._chunks: ChunkedDecoder | None = None  # None: a sized or close-delimited body
        self._length = -1  # of a sized body
        self._received = 0
        self._events: EventSplitter | None = None  # set once the head has been read

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            if self._events is None:
                data = self._read_head(data)
            if self._events is not None and not self.finished.done():
                self._read_body(data)
        except Exception as exc:  # a bad head or event: the request fails with it
            self._finish(exc)

    def _read_head(self, data: bytes) -> bytes:
        self._head += data
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > MAX_HEAD_BYTES:
                raise ValueError("the response head is too long")
            return b""
        status_line, *lines = self._head[:end].split(b"\r\n")
        if int(status_line.split()[1]) != 200:
            raise HTTPStatusError(status_line.decode(errors="replace"))
        headers = {}
        for line in lines:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            self._chunks = ChunkedDecoder()
        self._length = int(headers.get(b"content-length", -1))
        self._events = EventSplitter()
        return self._head[end + 4 :]

    def _read_body(self, data: bytes) -> None:
        assert self._events is not None
        self._received += len(data)
        events = self._events.feed(data if self._chunks is None else self._chunks.feed(data))
        if events:
            self.on_events(events)
        if self._chunks.done if self._chunks is not None else self._received == self._length:
            self._finish(None)

    def _finish(self, error: Exception | None) -> None:
        if not self.finished.done():
            if error is None:
                self.finished.set_result(None)
            else:
                self.finished.set_exception(error)
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        delimited = self._events is not None and self._chunks is None and self._length < 0
        if not self.finished.done() and delimited and exc is None:
            self.finished.set_result(None)  # a body delimited by the connection's end
        elif not self.finished.done():
            self.finished.set_exception(exc or ConnectionError("closed before the response ended"))


async def stream_events(url: str, body: bytes, on_events: Callable[[list[bytes]], None]) -> None:
    """POST `body` (JSON) to `url` and hand the events' data payloads (`[DONE]` included) to
    `on_events`, a list for each read from the socket, until the response ends. Raises
    HTTPStatusError for a status other than 200, OSError when the connection fails or ends
    early, and what `on_events` raises. asyncio only."""
    host, port, request = _request(url, body)
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_connection(
        lambda: EventStreamProtocol(on_events), host, port
    )
    try:
        transport.write(request)
        await protocol.finished
    finally:
        transport.close()
