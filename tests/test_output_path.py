"""The output path's parts, one at a time: merging the deltas a slow consumer has not taken yet
(the async client's DeltaCollector), and the benchmark client's HTTP chunk and server-sent
event parsing, fed in every split a socket may give."""

from __future__ import annotations

import asyncio

import anyio
import msgspec
import pytest

from pagedserve.actors.messages import FinishReason, RequestDelta, RequestError, TokenLogprobs
from pagedserve.api.bench_serve import CHUNK_DECODER, RequestTiming, record
from pagedserve.api.client import DeltaCollector
from pagedserve.api.client_core import merge_delta
from pagedserve.api.sse_client import (
    ChunkedDecoder,
    EventSplitter,
    HTTPStatusError,
    stream_events,
)


def _logprob(token: int) -> TokenLogprobs:
    return TokenLogprobs(token, -0.5, 1, [token], [-0.5])


def _delta(tokens: list[int], text: str, offset: int, **fields) -> RequestDelta:
    return RequestDelta(
        seq=7, text=text, token_ids=tokens, token_offset=offset, text_offset=offset, **fields
    )


def test_merged_deltas_read_as_one_delta_of_both() -> None:
    first = _delta([1], "a", 0, prompt_token_ids=[9, 9], num_cached_tokens=2,
                   logprobs=[_logprob(1)])  # fmt: skip
    second = _delta([2, 3], "bc", 1, logprobs=[_logprob(2), _logprob(3)])
    last = _delta([4], "d", 3, logprobs=[_logprob(4)], finish_reason=FinishReason.STOP,
                  stop_reason="zz")  # fmt: skip
    merge_delta(first, second)
    merge_delta(first, last)
    assert first.text == "abcd" and first.token_ids == [1, 2, 3, 4]
    assert [e.token_id for e in first.logprobs or []] == [1, 2, 3, 4]
    assert (first.token_offset, first.text_offset) == (0, 0)
    assert first.prompt_token_ids == [9, 9] and first.num_cached_tokens == 2
    assert (first.finish_reason, first.stop_reason) == (FinishReason.STOP, "zz")


def test_a_first_delta_merged_late_keeps_the_prompt() -> None:
    pending = _delta([], "", 0)
    merge_delta(pending, _delta([5], "x", 0, prompt_token_ids=[1], num_cached_tokens=1))
    assert pending.prompt_token_ids == [1] and pending.num_cached_tokens == 1
    assert pending.logprobs is None and pending.finish_reason is None


async def test_collector_merges_what_waits_and_keeps_the_error_last() -> None:
    collector = DeltaCollector()
    collector.put(_delta([1], "a", 0))
    assert (await collector.get()).token_ids == [1]  # type: ignore[union-attr]
    collector.put(_delta([2], "b", 1))
    collector.put(_delta([3], "c", 2))
    collector.put(RequestError(seq=7, message="gone", status_code=503))
    merged = await collector.get()
    assert isinstance(merged, RequestDelta) and merged.token_ids == [2, 3] and merged.text == "bc"
    error = await collector.get()
    assert isinstance(error, RequestError) and error.status_code == 503


async def test_collector_wakes_its_waiting_consumer() -> None:
    collector = DeltaCollector()
    got: list[object] = []

    async def consume() -> None:
        got.append(await collector.get())

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await anyio.sleep(0.01)
        assert not got
        collector.put(_delta([1], "a", 0))
    assert len(got) == 1
    with pytest.raises(TimeoutError), anyio.fail_after(0.05):
        await collector.get()  # nothing left: it waits


# ---------------------------------------------------------------- the benchmark client


def _chunked(payloads: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in payloads) + b"0\r\n\r\n"


EVENTS = [
    b'{"id":"c","choices":[{"index":0,"text":" to\\n\\nbe"}]}',
    b'{"id":"c","choices":[{"index":0,"text":"\xc3\xa9"}]}',
    b'{"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}',
    b"[DONE]",
]


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 64, 10_000])
def test_chunks_and_events_in_any_split(piece: int) -> None:
    body = _chunked([b"data: " + event + b"\n\n" for event in EVENTS])
    decoder, splitter, payloads = ChunkedDecoder(), EventSplitter(), []
    for start in range(0, len(body), piece):
        payloads += splitter.feed(decoder.feed(body[start : start + piece]))
    assert payloads == EVENTS and decoder.done


def test_an_event_split_over_chunks_and_crlf_lines() -> None:
    stream = b"data: " + EVENTS[0] + b"\r\n\r\n: a comment\n\ndata: [DONE]\n\n"
    body = _chunked([stream[:10], stream[10:40], stream[40:]])
    assert EventSplitter().feed(ChunkedDecoder().feed(body)) == [EVENTS[0], b"[DONE]"]


def test_the_benchmark_reads_arrivals_and_the_token_count() -> None:
    timing = RequestTiming(start=0.0)
    for data in EVENTS[:3]:
        record(timing, CHUNK_DECODER.decode(data))
    assert len(timing.stamps) == 2 and timing.num_tokens == 2
    with pytest.raises(msgspec.DecodeError):
        CHUNK_DECODER.decode(b'{"choices": 3}')


async def _answer(response: bytes, pieces: int) -> list[bytes]:
    """The payloads `stream_events` reads from a server that answers `response` in `pieces`
    writes (then closes the connection)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        step = max(1, len(response) // pieces)
        for start in range(0, len(response), step):
            writer.write(response[start : start + step])
            await writer.drain()
            await asyncio.sleep(0.001)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    payloads: list[bytes] = []
    try:
        await stream_events(f"http://127.0.0.1:{port}/v1/completions", b"{}", payloads.extend)
    finally:
        server.close()
    return payloads


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
SSE = b"".join(b"data: " + event + b"\n\n" for event in EVENTS)


@pytest.mark.parametrize("pieces", [1, 5, 40])
async def test_stream_events_reads_chunked_sized_and_close_delimited_bodies(pieces) -> None:
    chunked = HEAD + b"transfer-encoding: chunked\r\n\r\n" + _chunked([SSE[:50], SSE[50:]])
    sized = HEAD + b"content-length: %d\r\n\r\n" % len(SSE) + SSE
    delimited = HEAD + b"\r\n" + SSE
    for response in (chunked, sized, delimited):
        assert await _answer(response, pieces) == EVENTS


async def test_stream_events_fails_on_an_error_status_or_a_cut_body() -> None:
    with pytest.raises(HTTPStatusError, match="404"):
        await _answer(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n", 1)
    cut = HEAD + b"transfer-encoding: chunked\r\n\r\n" + _chunked([SSE])[:-20]
    with pytest.raises(OSError):
        await _answer(cut, 3)
