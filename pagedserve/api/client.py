"""ZeroMQ clients of the engine, sync and async: msgspec messages straight to the tokenizer
actor's ROUTER socket, streamed `RequestDelta`s back. The offline `LLM` and the HTTP server
are both built on these: one path to the engine.

    with Client(address) as client:
        for delta in client.generate("To be, or not", SamplingParams(max_tokens=20)):
            print(delta.text, end="")

    async with AsyncClient(address) as client:
        async for delta in client.generate([1, 2, 3], SamplingParams(max_tokens=20)):
            ...
"""

from __future__ import annotations

import collections
import itertools
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import anyio.abc
import msgspec
import zmq
import zmq.asyncio

from pagedserve.actors import bus
from pagedserve.actors.messages import (
    AbortRequest,
    ChatMessage,
    ClientOutbound,
    DeltaBatch,
    GenerateRequest,
    RequestDelta,
    RequestError,
    SamplingParams,
    SchedulerStats,
    StatsRequest,
)

Prompt = str | list[int] | list[ChatMessage]


class EngineRequestError(ValueError):
    """The engine rejected a request (bad input); `status_code` is the HTTP status to use."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.status_code = status_code


def make_request(request_id: str, prompt: Prompt, sampling: SamplingParams) -> GenerateRequest:
    if isinstance(prompt, str):
        return GenerateRequest(request_id=request_id, sampling=sampling, prompt=prompt)
    if prompt and isinstance(prompt[0], ChatMessage):
        return GenerateRequest(request_id=request_id, sampling=sampling, messages=prompt)  # type: ignore[arg-type]
    return GenerateRequest(request_id=request_id, sampling=sampling, prompt_token_ids=prompt)  # type: ignore[arg-type]


def fan_out(request_id: str, sampling: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """n > 1 becomes n engine requests sharing the prompt (and so its cached KV blocks).
    Child i of a seeded request uses seed + i, so each is reproducible on its own."""
    if sampling.n == 1:
        return [(request_id, sampling)]
    children = []
    for i in range(sampling.n):
        seed = None if sampling.seed is None else sampling.seed + i
        children.append((f"{request_id}#{i}", msgspec.structs.replace(sampling, n=1, seed=seed)))
    return children


class _Ids:
    def __init__(self) -> None:
        self.prefix = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.counter = itertools.count()

    def next(self) -> str:
        return f"{self.prefix}-{next(self.counter)}"


def unbatch(
    message: RequestDelta | DeltaBatch | RequestError | SchedulerStats | None,
) -> list[RequestDelta | RequestError | SchedulerStats]:
    """A frame as the messages it carries (a DeltaBatch holds one step's deltas)."""
    if message is None:
        return []
    if isinstance(message, DeltaBatch):
        return list(message.deltas)
    return [message]


def _raise_if_error(message: Any) -> None:
    if isinstance(message, RequestError):
        raise EngineRequestError(message.message, message.status_code)


class Client:
    """Synchronous client. Not thread-safe: one thread drives it."""

    def __init__(self, address: str) -> None:
        self._ctx = zmq.Context()
        self._ids = _Ids()
        self._socket = bus.dealer_socket(self._ctx, address, self._ids.prefix.encode())
        self._codec: bus.Codec[RequestDelta | DeltaBatch | RequestError | SchedulerStats] = (
            bus.Codec(ClientOutbound, "client")
        )
        self._pending: collections.deque[RequestDelta | RequestError | SchedulerStats] = (
            collections.deque()
        )

    def submit(self, request: GenerateRequest) -> None:
        self._socket.send(bus.encode(request))

    def abort(self, request_ids: list[str]) -> None:
        self._socket.send(bus.encode(AbortRequest(request_ids)))

    def receive(
        self, timeout_ms: int | None = None
    ) -> RequestDelta | RequestError | SchedulerStats | None:
        """The next message for this client, or None after `timeout_ms`."""
        while not self._pending:
            if timeout_ms is not None and not self._socket.poll(timeout_ms):
                return None
            self._pending.extend(unbatch(self._codec.decode(self._socket.recv())))
        return self._pending.popleft()

    def generate(
        self, prompt: Prompt, sampling: SamplingParams | None = None
    ) -> Iterator[RequestDelta]:
        """Stream one request's deltas (n must be 1; use `submit` for many at once)."""
        request = make_request(self._ids.next(), prompt, sampling or SamplingParams())
        self.submit(request)
        try:
            while True:
                message = self.receive()
                if getattr(message, "request_id", None) != request.request_id:
                    continue
                _raise_if_error(message)
                if isinstance(message, RequestDelta):
                    yield message
                    if message.finish_reason is not None:
                        return
        except GeneratorExit:
            self.abort([request.request_id])
            raise

    def stats(self, timeout_ms: int = 10_000) -> SchedulerStats:
        request_id = self._ids.next()
        self._socket.send(bus.encode(StatsRequest(request_id)))
        while True:
            message = self.receive(timeout_ms)
            if message is None:
                raise TimeoutError("no stats from the engine")
            if isinstance(message, SchedulerStats) and message.request_id == request_id:
                return message

    def next_request_id(self) -> str:
        return self._ids.next()

    def close(self) -> None:
        self._socket.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """Asynchronous client: one socket, one reader task, a stream per live request."""

    def __init__(self, address: str) -> None:
        self._ctx = zmq.asyncio.Context()
        self._ids = _Ids()
        self._socket = bus.dealer_socket(self._ctx, address, self._ids.prefix.encode())
        self._codec: bus.Codec[RequestDelta | DeltaBatch | RequestError | SchedulerStats] = (
            bus.Codec(ClientOutbound, "async-client")
        )
        self._streams: dict[str, anyio.abc.ObjectSendStream] = {}
        self._task_group: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> AsyncClient:
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._task_group.start_soon(self._read_loop)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task_group is not None
        self._task_group.cancel_scope.cancel()
        await self._task_group.__aexit__(None, None, None)
        self._socket.close(linger=0)
        self._ctx.term()

    async def _read_loop(self) -> None:
        while True:
            for message in unbatch(self._codec.decode(await self._socket.recv())):
                self._deliver(message)

    def _deliver(self, message: RequestDelta | RequestError | SchedulerStats) -> None:
        stream = self._streams.get(message.request_id)
        if stream is None:
            return
        try:
            stream.send_nowait(message)  # the buffer is unbounded in practice
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # its consumer left (an abort is on its way)

    async def _open(self, request_id: str) -> anyio.abc.ObjectReceiveStream:
        send, receive = anyio.create_memory_object_stream[Any](max_buffer_size=1 << 20)
        self._streams[request_id] = send
        return receive

    def _close(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.close()

    async def generate(
        self, prompt: Prompt, sampling: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestDelta]:
        """Stream one request's deltas; leaving the loop early aborts the request."""
        request = make_request(request_id or self._ids.next(), prompt, sampling or SamplingParams())
        receive = await self._open(request.request_id)
        finished = False
        try:
            await self._socket.send(bus.encode(request))
            async with receive:
                async for message in receive:
                    _raise_if_error(message)
                    finished = message.finish_reason is not None
                    yield message
                    if finished:
                        return
        finally:
            self._close(request.request_id)
            if not finished:
                await self.abort([request.request_id])

    async def abort(self, request_ids: list[str]) -> None:
        with anyio.CancelScope(shield=True):
            await self._socket.send(bus.encode(AbortRequest(request_ids)))

    async def stats(self, timeout_s: float = 10.0) -> SchedulerStats:
        request_id = self._ids.next()
        receive = await self._open(request_id)
        try:
            await self._socket.send(bus.encode(StatsRequest(request_id)))
            with anyio.fail_after(timeout_s):
                return await receive.receive()
        finally:
            self._close(request_id)

    def next_request_id(self) -> str:
        return self._ids.next()
