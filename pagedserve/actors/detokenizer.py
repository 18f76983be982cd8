"""The detokenizer process: the engine's way out. Token outputs in, text deltas to clients.

The scheduler announces each request it accepts (a `Route`: the client, its number for the
request, the prompt and the sampling settings) before the request's first tokens, in the same
ordered channel, so the detokenizer learns every route from the request's owner. For each step
it turns new tokens into text (incremental, UTF-8 safe, stop strings), and sends each client
one frame with all its deltas. A stop string ends the request here: the final delta goes out
and the scheduler is told to stop computing it. A pooling request's one output is its final
delta, with its vector (`embedding`) and no tokens. Refusals from the tokenizer and the scheduler
and stats replies reach their clients through here too: clients have one way in.

Clients connect a DEALER to its ROUTER (Hello -> Welcome) and probe it (Ping -> Pong); both
answers carry the supervisor's epoch, which changes when an actor was restarted: a client then
resubmits the requests it still waits for (see api/client.py). A route for a request the
detokenizer does not know yet, with output already generated (such a resubmission, or a restart
of this actor), replays that output from its start; outputs carry their offsets in the output,
so a stream never sends a token twice (a route may already hold the tokens of an output in the
same message), and deltas carry theirs, so a client keeps only what it lacks. After a scheduler
restart it forgets the old scheduler's handles. When the engine is dead (`EngineFailed`), every
request it streams ends with a 503 at once, and every later Welcome or Pong carries the reason,
so clients fail fast.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

import anyio

from pagedserve.actors import bus
from pagedserve.actors.actor import Actor
from pagedserve.actors.incremental_detokenizer import (
    DetokenizeResult,
    IncrementalDetokenizer,
    TokenDecoder,
)
from pagedserve.actors.messages import (
    ClientControl,
    DeltaBatch,
    DetokenizerInbound,
    EngineFailed,
    EngineOutputs,
    EpochChanged,
    FinishReason,
    Hello,
    Pong,
    RequestDelta,
    RequestError,
    RequestOutput,
    Route,
    SchedulerInbound,
    SchedulerStats,
    Shutdown,
    StopRequests,
    TokenLogprobs,
    Welcome,
)
from pagedserve.actors.timeline import Timeline


@dataclass
class OutputStream:
    """One request's way to its client: what has been sent and the text state."""

    client: bytes
    seq: int
    prompt_token_ids: list[int]
    text: IncrementalDetokenizer | None  # None: an engine without a tokenizer (ids only)
    num_tokens: int = 0  # output tokens sent
    text_length: int = 0  # output characters sent
    first_sent: bool = False

    def push(
        self,
        token_ids: list[int],
        logprobs: list[TokenLogprobs] | None,
        finish: FinishReason | None,
        stop_reason: int | str | None,
        num_cached_tokens: int,
    ) -> RequestDelta:
        """The delta for new tokens. When they complete a stop string, finish is STOP and the
        delta ends with the token that completed it (a step may emit several tokens)."""
        text, count = self._detokenize(token_ids, finished=finish is not None)
        if count < len(token_ids) or text.stop_string is not None:
            finish, stop_reason = FinishReason.STOP, text.stop_string
            token_ids = token_ids[:count]
            logprobs = None if logprobs is None else logprobs[:count]
        delta = RequestDelta(
            seq=self.seq, text=text.text_delta, token_ids=token_ids, logprobs=logprobs,
            finish_reason=finish, stop_reason=stop_reason,
            token_offset=self.num_tokens, text_offset=self.text_length,
        )  # fmt: skip
        if not self.first_sent:
            delta.prompt_token_ids = self.prompt_token_ids
            delta.num_cached_tokens = num_cached_tokens
            self.first_sent = True
        self.num_tokens += len(token_ids)
        self.text_length += len(text.text_delta)
        return delta

    def unsent(self, output: RequestOutput) -> tuple[list[int], list[TokenLogprobs] | None]:
        """The output's tokens (and logprobs) this stream has not sent yet. A route built
        after a step's result was applied (a resubmission handled in the same batch as the
        result) already holds that step's tokens; its output then repeats them."""
        sent = self.num_tokens - output.output_offset
        if sent <= 0:
            return output.new_token_ids, output.new_logprobs
        logprobs = output.new_logprobs
        return output.new_token_ids[sent:], None if logprobs is None else logprobs[sent:]

    def _detokenize(self, token_ids: list[int], finished: bool) -> tuple[DetokenizeResult, int]:
        """The text of `token_ids` and how many of them count: all, or up to the one that
        completes a stop string (tokens go in one at a time when there are several)."""
        if self.text is None:
            return DetokenizeResult(""), len(token_ids)
        if len(token_ids) <= 1:
            return self.text.update(token_ids, finished), len(token_ids)
        pieces = []
        for index, token in enumerate(token_ids):
            last = index == len(token_ids) - 1
            result = self.text.update([token], finished and last)
            pieces.append(result.text_delta)
            if result.stop_string is not None:
                return DetokenizeResult("".join(pieces), result.stop_string), index + 1
        return DetokenizeResult("".join(pieces)), len(token_ids)


class DetokenizerActor(Actor):
    name = "detokenizer"
    timeline: Timeline | None = None

    async def setup(self) -> dict:
        if self.config.profile is not None:
            self.timeline = Timeline()
        self.decoder = None
        if not self.config.skip_tokenizer_init:
            self.decoder = TokenDecoder.load(self.config.tokenizer_path)
        self.clients: bus.Router[ClientControl] = bus.Router(
            self.ctx, self.addresses.outputs, ClientControl
        )
        self.inbox: bus.Receiver[DetokenizerInbound] = bus.Receiver(
            self.ctx, self.addresses.detokenizer_inbox, DetokenizerInbound,
            poll_first_s=bus.POLL_FIRST_S, meanwhile=(self.clients.socket, self.answer_clients),
        )  # fmt: skip
        self.to_scheduler: bus.Sender[SchedulerInbound] = bus.Sender(
            self.ctx, self.addresses.scheduler_inbox
        )
        self.streams: dict[int, OutputStream] = {}  # by handle
        self.failure = ""  # why the engine is dead, once it is
        return {}

    def queue_depths(self) -> dict[str, int]:
        return {"streams": len(self.streams)}

    def close(self) -> None:
        if self.timeline is not None and self.config.profile is not None:
            path = os.path.join(self.config.profile.output_dir, "detokenizer.timeline.json")
            self.timeline.write(path)
        super().close()

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.serve_clients)
            await self.serve_engine()
            tg.cancel_scope.cancel()

    async def serve_clients(self) -> None:
        """Hello -> Welcome, Ping -> Pong: connection and liveness, with the epoch (while the
        inbox polls, `answer_clients` serves them)."""
        while True:
            await self.answer(*await self.clients.recv())

    async def answer_clients(self) -> None:
        for client, message in self.clients.recv_ready():
            await self.answer(client, message)

    async def answer(self, client: bytes, message: ClientControl) -> None:
        kind = Welcome if isinstance(message, Hello) else Pong
        await self.clients.send(client, kind(self.epoch, self.failure))

    async def serve_engine(self) -> None:
        while True:
            message = await self.inbox.recv()
            if isinstance(message, Shutdown):
                return
            if isinstance(message, EngineOutputs):
                await self.on_outputs(message)
            elif isinstance(message, EpochChanged):
                self.epoch = message.epoch
                for handle in [h for h in self.streams if h < message.drop_handles_below]:
                    del self.streams[handle]
            elif isinstance(message, EngineFailed):
                await self.fail_all(message.message)
            else:
                await self.forward(message)
            await anyio.lowlevel.checkpoint()  # serve_clients' turn: a polled frame skips it

    async def fail_all(self, failure: str) -> None:
        """The engine is dead: a 503 for every request streamed now."""
        self.failure = failure
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            error = RequestError(seq=stream.seq, message=failure, status_code=503)
            await self.clients.send(stream.client, error)

    async def forward(self, message: RequestError | SchedulerStats) -> None:
        """A refusal or a stats reply, to the client it names."""
        client, message.client = message.client, b""
        await self.clients.send(client, message)

    async def on_outputs(self, message: EngineOutputs) -> None:
        """One frame per client: the deltas of all its requests in this step."""
        if self.timeline is not None:
            self.timeline.mark_all("detok_in", (o.handle for o in message.outputs))
        batches: dict[bytes, list[RequestDelta]] = defaultdict(list)
        stopped: list[int] = []
        for route in message.routes:
            stream = self.open_stream(route)
            if stream is not None and (route.output_token_ids or route.finish_reason is not None):
                delta = stream.push(route.output_token_ids, None, route.finish_reason,
                                    route.stop_reason, 0)  # fmt: skip
                delta.embedding = route.pooled
                self.close_if_final(route.handle, delta, route.finish_reason, stopped)
                batches[stream.client].append(delta)
        for error in message.errors:
            await self.forward(error)
        for output in message.outputs:
            stream = self.streams.get(output.handle)
            if stream is None:
                continue  # finished here already (a stop string), or never routed
            token_ids, logprobs = stream.unsent(output)
            if not token_ids and output.finish_reason is None and not output.prompt_logprobs:
                continue  # its route, in this message, carried these tokens already
            delta = stream.push(token_ids, logprobs, output.finish_reason, output.stop_reason,
                                output.num_cached_tokens)  # fmt: skip
            delta.prompt_logprobs, delta.embedding = output.prompt_logprobs, output.pooled
            self.close_if_final(output.handle, delta, output.finish_reason, stopped)
            batches[stream.client].append(delta)
        if self.timeline is not None:  # marked before the sends: a client may be quicker
            self.timeline.mark_all("detok_out", (o.handle for o in message.outputs))
        for client, deltas in batches.items():
            await self.clients.send(client, DeltaBatch(deltas))
        if stopped:
            await self.to_scheduler.send(StopRequests(stopped))

    def open_stream(self, route: Route) -> OutputStream | None:
        """A stream for a route the detokenizer does not know yet (None if it does)."""
        if route.handle in self.streams:
            return None
        text = None
        if self.decoder is not None:
            text = IncrementalDetokenizer(self.decoder, route.prompt_token_ids, route.sampling)
        stream = OutputStream(route.client, route.seq, route.prompt_token_ids, text)
        self.streams[route.handle] = stream
        return stream

    def close_if_final(
        self, handle: int, delta: RequestDelta, engine_finish: FinishReason | None,
        stopped: list[int],
    ) -> None:  # fmt: skip
        """Forget the stream once `delta` ends it; if a stop string ended it here and the
        engine has not finished it (`engine_finish`), the scheduler is to stop it (`stopped`):
        a step's new tokens, or a replayed route's (its detokenizer died before telling)."""
        if delta.finish_reason is not None:
            del self.streams[handle]
            if engine_finish is None:
                stopped.append(handle)
