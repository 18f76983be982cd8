"""ZeroMQ clients of the engine, sync and async: msgspec messages straight to the engine, streamed
`RequestDelta`s back. The offline `LLM` and the HTTP server are both built on these.

    with Client(engine_address) as client:   # what `pagedserve serve` prints: ipc://... or tcp://...
        for delta in client.generate("To be, or not", SamplingParams(max_tokens=20)):
            print(delta.text, end="")

    async with AsyncClient(engine_address) as client:
        async for delta in client.generate([1, 2, 3], SamplingParams(max_tokens=20)):
            ...

A client sends requests to the tokenizer and receives from the detokenizer (one DEALER each,
under one identity). The async client hands each request's events to its consumer through a
`DeltaCollector`: deltas that arrive while the consumer is still busy with an earlier one are
merged into one (as vLLM's output collector does), so a consumer that falls behind catches up
with fewer, larger deltas instead of a queue.

Connecting waits for the engine's Welcome (EngineUnavailableError after `connect_timeout_s`);
while requests wait, the client pings the engine every second, and if the engine stays silent
for `liveness_timeout_s`, every waiting request ends with a 503 error: no call waits without a
deadline (silence is measured from the oldest ping still unanswered).
Resubmission after an engine restart: see client_core.py.

Every engine socket is authenticated (actors/security.py): `credentials` is the run's
`Credentials`, or the API key the engine was started with; for an ipc:// engine it defaults to
the credentials file its supervisor wrote in the run directory.
"""

from __future__ import annotations

import collections
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import anyio.abc

from pagedserve.actors import bus
from pagedserve.actors.addresses import Addresses
from pagedserve.actors.messages import (
    AbortRequest,
    ClientOutbound,
    GenerateRequest,
    Hello,
    LoRARequest,
    Ping,
    Pong,
    PoolingParams,
    PromptOptions,
    RequestDelta,
    RequestError,
    SamplingParams,
    SchedulerStats,
    StatsRequest,
    Welcome,
)
from pagedserve.actors.security import Credentials, client_credentials
from pagedserve.api.client_core import (
    CONNECT_TIMEOUT_S,
    LIVENESS_TIMEOUT_S,
    PING_INTERVAL_S,
    ClientCore,
    EngineRequestError,
    EngineUnavailableError,
    Event,
    Prompt,
    fan_out,
    merge_delta,
    raise_if_error,
)

__all__ = ["AsyncClient", "Client", "EngineRequestError", "EngineUnavailableError", "fan_out"]


def _unreachable(address: str, seconds: float) -> EngineUnavailableError:
    return EngineUnavailableError(f"no pagedserve engine answered at {address} in {seconds:g} s")


def _credentials(address: str, credentials: Credentials | str | None) -> Credentials:
    try:
        return client_credentials(address, credentials)
    except PermissionError as exc:
        raise EngineUnavailableError(f"no pagedserve engine answered at {address}: {exc}") from None


def _silent_engine_errors(core: ClientCore, seconds: float) -> list[Event]:
    """A 503 for every waiting request of a client whose engine went silent."""
    message = f"the engine stopped answering ({seconds:g} s without a reply)"
    errors: list[Event] = [
        RequestError(seq=seq, message=message, status_code=503) for seq in core.requests
    ]
    for error in errors:
        core.events(error)  # type: ignore[arg-type]
    return errors


class Client:
    """Synchronous client. Not thread-safe: one thread drives it."""

    def __init__(
        self,
        address: str,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        liveness_timeout_s: float = LIVENESS_TIMEOUT_S,
        credentials: Credentials | str | None = None,
    ) -> None:
        self.address, self.liveness_timeout_s = address, liveness_timeout_s
        addresses = Addresses.from_engine_address(address)
        self.core = ClientCore()
        self._ctx = bus.sync_context(_credentials(address, credentials))
        self._requests = bus.dealer_socket(self._ctx, addresses.requests, self.core.identity)
        self._outputs = bus.dealer_socket(self._ctx, addresses.outputs, self.core.identity)
        self._codec: bus.Codec[Any] = bus.Codec(ClientOutbound, "client")
        self._pending: collections.deque[Event] = collections.deque()
        self._last_ping = 0.0
        self._unanswered_since: float | None = None  # the oldest ping with no frame since
        try:
            self._connect(connect_timeout_s)
        except BaseException:
            self.close()
            raise

    def _connect(self, timeout_s: float) -> None:
        self._outputs.send(bus.encode(Hello()))
        deadline = time.monotonic() + timeout_s
        while self.core.epoch is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._outputs.poll(int(remaining * 1000) + 1):
                raise _unreachable(self.address, timeout_s)
            self._accept(self._codec.decode(self._outputs.recv()))

    def submit(
        self,
        prompt: Prompt,
        sampling: SamplingParams,
        label: str | None = None,
        options: PromptOptions | None = None,
        priority: int = 0,
        lora: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
    ) -> int:
        """Send a request; returns its seq (deltas and errors name it). `options`: how the
        engine's tokenizer makes the prompt's ids (special tokens, chat template settings);
        `priority`: with priority scheduling, lower is admitted first; `lora`: the LoRA
        adapter it runs with (an engine with enable_lora); `pooling`: an embedding of the
        prompt (its one delta's `embedding`) rather than output tokens."""
        request = self.core.track(prompt, sampling, label, options, priority, lora, pooling)
        refusal = self.core.refusal(request.seq)
        if refusal is not None:
            self._pending.append(refusal)
        else:
            self._send(request)
        return request.seq

    def abort(self, labels: list[str]) -> None:
        self.abort_seqs(self.core.seqs_labelled(labels))

    def abort_seqs(self, seqs: list[int]) -> None:
        for seq in seqs:
            self.core.forget(seq)
        if seqs:
            self._send(AbortRequest(seqs=seqs))

    def receive(self, timeout_ms: int | None = None) -> Event | None:
        """The next event for this client (a delta, a refusal or stats), or None after
        `timeout_ms`."""
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while not self._pending:
            self._keep_alive()
            wait = PING_INTERVAL_S
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    return None
            if self._outputs.poll(int(wait * 1000) + 1):
                self._accept(self._codec.decode(self._outputs.recv()))
        return self._pending.popleft()

    def generate(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        options: PromptOptions | None = None,
        priority: int = 0,
        lora: LoRARequest | None = None,
    ) -> Iterator[Any]:
        """Stream one request's deltas (n must be 1; use `submit` for many at once)."""
        sampling = sampling or SamplingParams()
        seq = self.submit(prompt, sampling, options=options, priority=priority, lora=lora)
        finished = False
        try:
            while not finished:
                event = self.receive()
                if isinstance(event, SchedulerStats) or event is None or event.seq != seq:
                    continue
                raise_if_error(event)
                finished = event.finish_reason is not None  # type: ignore[union-attr]
                yield event
        finally:
            if not finished and seq in self.core.requests:
                self.abort_seqs([seq])

    def stats(self, timeout_ms: int = 10_000) -> SchedulerStats:
        seq = self.core.next_seq()
        self._send(StatsRequest(seq=seq))
        deadline = time.monotonic() + timeout_ms / 1000
        others: list[Event] = []  # other requests' events, kept for receive()
        try:
            while (remaining := deadline - time.monotonic()) > 0:
                event = self.receive(int(remaining * 1000) + 1)
                if isinstance(event, SchedulerStats) and event.seq == seq:
                    return event
                if event is not None and not isinstance(event, SchedulerStats):
                    others.append(event)
        finally:
            self._pending.extendleft(reversed(others))
        raise TimeoutError("no stats from the engine")

    def _send(self, message: GenerateRequest | AbortRequest | StatsRequest) -> None:
        self._requests.send(bus.encode(message))

    def _accept(self, message: Any) -> None:
        self._unanswered_since = None
        if isinstance(message, (Welcome, Pong)) and message.failure:
            self._pending.extend(self.core.on_failure(message.failure))
            self.core.epoch = message.epoch
        elif isinstance(message, (Welcome, Pong)):
            for request in self.core.on_epoch(message):
                self._send(request)
        elif message is not None:
            self._pending.extend(self.core.events(message))

    def _keep_alive(self) -> None:
        now = time.monotonic()
        if now - self._last_ping >= PING_INTERVAL_S:
            self._outputs.send(bus.encode(Ping()))
            self._last_ping = now
            if self._unanswered_since is None:
                self._unanswered_since = now
        silent = 0.0 if self._unanswered_since is None else now - self._unanswered_since
        if self.core.requests and silent > self.liveness_timeout_s:
            self._pending.extend(_silent_engine_errors(self.core, self.liveness_timeout_s))

    def close(self) -> None:
        self._requests.close(linger=0)
        self._outputs.close(linger=0)
        self._ctx.destroy(linger=0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DeltaCollector:
    """One request's events on their way to its consumer: at most one delta waits (later ones
    merge into it) and then at most one final event (an error, or the stats asked for)."""

    def __init__(self) -> None:
        self._delta: RequestDelta | None = None
        self._last: Event | None = None  # RequestError or SchedulerStats: nothing follows it
        self._ready = anyio.Event()

    def put(self, event: Event) -> None:
        if not isinstance(event, RequestDelta):
            self._last = event
        elif self._delta is None:
            self._delta = event
        else:
            merge_delta(self._delta, event)
        self._ready.set()

    async def get(self) -> Event:
        """The next event: the waiting deltas merged into one, else the final event."""
        while self._delta is None and self._last is None:
            await self._ready.wait()
            self._ready = anyio.Event()
        event, self._delta = self._delta, None
        if event is None:
            event, self._last = self._last, None
        return event  # type: ignore[return-value]


class AsyncClient:
    """Asynchronous client: two sockets, a reader task, a keep-alive task, a stream per
    request."""

    def __init__(
        self,
        address: str,
        connect_timeout_s: float | None = CONNECT_TIMEOUT_S,
        liveness_timeout_s: float = LIVENESS_TIMEOUT_S,
        credentials: Credentials | str | None = None,
    ) -> None:
        """connect_timeout_s None: do not wait for the engine on entering (a server that must
        answer its own health checks while the engine is away)."""
        self.address = address
        self.connect_timeout_s, self.liveness_timeout_s = connect_timeout_s, liveness_timeout_s
        addresses = Addresses.from_engine_address(address)
        self.core = ClientCore()
        self._ctx = bus.async_context(_credentials(address, credentials))
        self._requests = bus.dealer_socket(self._ctx, addresses.requests, self.core.identity)
        self._outputs = bus.dealer_socket(self._ctx, addresses.outputs, self.core.identity)
        self._codec: bus.Codec[Any] = bus.Codec(ClientOutbound, "async-client")
        self._collectors: dict[int, DeltaCollector] = {}  # by seq
        self._connected = anyio.Event()
        self._unanswered_since: float | None = None  # the oldest ping with no frame since
        self._task_group: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> AsyncClient:
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._task_group.start_soon(self._read_loop)
        self._task_group.start_soon(self._keep_alive)
        try:
            await self._outputs.send(bus.encode(Hello()))
            if self.connect_timeout_s is not None:
                with anyio.fail_after(self.connect_timeout_s):
                    await self._connected.wait()
        except TimeoutError:
            await self.__aexit__(None, None, None)
            raise _unreachable(self.address, self.connect_timeout_s or 0) from None
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task_group is not None
        self._task_group.cancel_scope.cancel()
        await self._task_group.__aexit__(None, None, None)
        self._requests.close(linger=0)
        self._outputs.close(linger=0)
        self._ctx.destroy(linger=0)

    async def _read_loop(self) -> None:
        while True:
            message = self._codec.decode(await self._outputs.recv())
            self._unanswered_since = None
            if isinstance(message, (Welcome, Pong)) and message.failure:
                for event in self.core.on_failure(message.failure):
                    self._deliver(event)
                self.core.epoch = message.epoch
                self._connected.set()
            elif isinstance(message, (Welcome, Pong)):
                for request in self.core.on_epoch(message):
                    await self._requests.send(bus.encode(request))
                self._connected.set()
            elif message is not None:
                for event in self.core.events(message):
                    self._deliver(event)

    async def _keep_alive(self) -> None:
        while True:
            await anyio.sleep(PING_INTERVAL_S)
            await self._outputs.send(bus.encode(Ping()))
            now = time.monotonic()
            if self._unanswered_since is None:
                self._unanswered_since = now
            if self.core.requests and now - self._unanswered_since > self.liveness_timeout_s:
                for event in _silent_engine_errors(self.core, self.liveness_timeout_s):
                    self._deliver(event)

    @property
    def num_streams(self) -> int:
        """Requests (and stats calls) whose consumer still waits for events."""
        return len(self._collectors)

    def _deliver(self, event: Event) -> None:
        collector = self._collectors.get(event.seq)
        if collector is not None:  # else its consumer left (an abort is on its way)
            collector.put(event)

    def _open(self, seq: int) -> DeltaCollector:
        collector = self._collectors[seq] = DeltaCollector()
        return collector

    def _close(self, seq: int) -> None:
        self._collectors.pop(seq, None)

    async def generate(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        options: PromptOptions | None = None,
        priority: int = 0,
        lora: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
    ) -> AsyncIterator[Any]:
        """Stream one request's deltas (`request_id`: a label for them; deltas that wait for
        the consumer arrive merged; `options`, `priority`, `lora` and `pooling` as
        Client.submit's); leaving the loop early aborts the request."""
        request = self.core.track(
            prompt, sampling or SamplingParams(), request_id, options, priority, lora, pooling
        )
        raise_if_error(self.core.refusal(request.seq))
        collector = self._open(request.seq)
        finished = False
        try:
            await self._requests.send(bus.encode(request))
            while not finished:
                event = await collector.get()
                raise_if_error(event)
                finished = event.finish_reason is not None  # type: ignore[union-attr]
                yield event
        finally:
            self._close(request.seq)
            if not finished and request.seq in self.core.requests:
                await self._abort_seqs([request.seq])

    async def abort(self, request_ids: list[str]) -> None:
        """Abort the live requests labelled with these ids."""
        await self._abort_seqs(self.core.seqs_labelled(request_ids))

    async def _abort_seqs(self, seqs: list[int]) -> None:
        for seq in seqs:
            self.core.forget(seq)
        if seqs:
            with anyio.CancelScope(shield=True):
                await self._requests.send(bus.encode(AbortRequest(seqs=seqs)))

    async def stats(self, timeout_s: float = 10.0) -> SchedulerStats:
        seq = self.core.next_seq()
        collector = self._open(seq)
        try:
            await self._requests.send(bus.encode(StatsRequest(seq=seq)))
            with anyio.fail_after(timeout_s):
                return await collector.get()  # type: ignore[return-value]
        finally:
            self._close(seq)
