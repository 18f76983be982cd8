"""A lean streaming HTTP/1.1 client for `pagedserve bench serve`: POST a JSON body, read the
server-sent events of the response as they arrive.

A benchmark client must cost far less per event than the server it measures: one Python
process parses every event of 1,000 streams. httpx spends tens of microseconds per event (h11's
state machine for each HTTP chunk, several async-iterator layers, a line decoder); here each
read from the socket (often many events at once) is split into chunks and events with a few
`bytes.find` calls. It speaks just enough HTTP for that: one request per connection, a
chunked, sized or close-delimited body, no TLS, no redirects.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import anyio
import anyio.abc

READ_SIZE = 1 << 16
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


async def _read_head(stream: anyio.abc.ByteStream) -> tuple[int, dict[bytes, bytes], bytes]:
    """The status, the headers (lower-case names) and the body bytes read with them."""
    data = b""
    while (end := data.find(b"\r\n\r\n")) < 0:
        if len(data) > MAX_HEAD_BYTES:
            raise ValueError("the response head is too long")
        data += await stream.receive(READ_SIZE)
    status_line, *lines = data[:end].split(b"\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, data[end + 4 :]


async def stream_events(url: str, body: bytes) -> AsyncIterator[list[bytes]]:
    """POST `body` (JSON) to `url`; yield the events' data payloads (`[DONE]` included) that
    each read from the socket completes. Raises HTTPStatusError for a status other than 200,
    anyio's stream errors (EndOfStream: the server closed before the body ended)."""
    host, port, request = _request(url, body)
    async with await anyio.connect_tcp(host, port) as stream:
        await stream.send(request)
        status, headers, data = await _read_head(stream)
        chunked = headers.get(b"transfer-encoding", b"").lower() == b"chunked"
        if status != 200:
            raise HTTPStatusError(f"HTTP {status}")
        length = int(headers.get(b"content-length", -1))
        body_decoder, splitter, received = ChunkedDecoder(), EventSplitter(), 0
        while True:
            received += len(data)
            events = splitter.feed(body_decoder.feed(data) if chunked else data)
            if events:
                yield events
            if body_decoder.done if chunked else received == length:
                return
            try:
                data = await stream.receive(READ_SIZE)
            except anyio.EndOfStream:
                if chunked or length >= 0:
                    raise
                return  # a body delimited by the connection's end
