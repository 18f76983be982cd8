"""The ASGI response of a generation call (or of a call answered with embeddings: one engine
request a text, answered whole). It runs the call's engine requests in the request's own task,
from the first delta to the last byte sent: the task group that merges several choices is
entered and left in that one task (so streams with n > 1 or a list of prompts end cleanly with
`data: [DONE]`), and a client that disconnects, streaming or not, cancels that task group,
which aborts every unfinished engine request."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AbstractAsyncContextManager

import anyio
import msgspec
from starlette.types import Receive, Scope, Send

from pagedserve.api.client import AsyncClient, EngineRequestError
from pagedserve.api.errors import error_response
from pagedserve.api.generation import Choice, Event, Job, open_choices
from pagedserve.api.metrics import Metrics, RequestTimer
from pagedserve.api.render import PooledRender, Render

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]


EventSource = Callable[[AsyncClient, list[Job]], AbstractAsyncContextManager[AsyncIterator[Event]]]


class GenerationResponse:
    """`source` runs the jobs (open_choices: one engine request each; a beam search: its
    steps) and gives their choices' deltas."""

    def __init__(
        self,
        client: AsyncClient,
        metrics: Metrics,
        render: Render | PooledRender,  # a PooledRender answers whole only
        jobs: list[Job],
        stream: bool,
        include_usage: bool,
        arrival: float,
        source: EventSource = open_choices,
    ) -> None:
        self.client = client
        self.source = source
        self.render = render
        self.jobs = jobs
        self.stream = stream
        self.include_usage = include_usage
        self.timers = {job.index: RequestTimer(metrics, arrival) for job in jobs}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rejected: EngineRequestError | None = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_cancel_on_disconnect, receive, tg.cancel_scope)
                try:
                    async with self.source(self.client, self.jobs) as events:
                        respond = self.send_stream if self.stream else self.send_whole
                        await respond(self.timed(events), send)
                except EngineRequestError as exc:  # raised before anything was sent
                    rejected = exc
                tg.cancel_scope.cancel()
        finally:
            if rejected is None:  # what did not finish was aborted (a disconnect)
                for timer in self.timers.values():
                    timer.on_abort()
        if rejected is not None:
            await error_response(str(rejected), rejected.status_code)(scope, receive, send)

    async def timed(self, events: AsyncIterator[Event]) -> AsyncIterator[Event]:
        async for index, delta in events:
            self.timers[index].on_delta(delta)
            yield index, delta

    async def send_whole(self, events: AsyncIterator[Event], send: Send) -> None:
        choices = [Choice(job.index) for job in self.jobs]
        async for index, delta in events:
            choices[index].add(delta)
        body = msgspec.json.encode(self.render.full(choices))
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def send_stream(self, events: AsyncIterator[Event], send: Send) -> None:
        """The headers go out once every choice has started, so a request the engine rejects
        (one prompt of several too long, say) is still an HTTP error; an error after that is
        an `error` event, and the stream always ends with `data: [DONE]`."""
        started: list[Event] = []
        started_choices: set[int] = set()
        async for event in events:
            started.append(event)
            started_choices.add(event[0])
            if len(started_choices) == len(self.jobs):
                break
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        try:
            async for chunk in self.render.stream(_chain(started, events), self.include_usage):
                await _send_event(send, chunk)
        except EngineRequestError as exc:
            error = {"message": str(exc), "type": "engine_error", "code": exc.status_code}
            await _send_event(send, {"error": error})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def _send_event(send: Send, chunk: dict) -> None:
    data = b"data: " + msgspec.json.encode(chunk) + b"\n\n"
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def _chain(first: Iterable[Event], rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    for event in first:
        yield event
    async for event in rest:
        yield event


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    """The request body has been read, so the next message is the client's disconnect."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
