"""The ZeroMQ clients' bookkeeping, without sockets: what a client asked for and what it holds.

A client numbers its requests (`seq`); the engine routes every delta by (client, seq). Deltas
carry their offsets in the output, so one that arrives again (the engine resends after a
restart) is trimmed to what the client lacks. Each detokenizer answer (Welcome, Pong) carries
the supervisor's epoch; when it changes, an actor was restarted and a request of ours may have
been lost in it, so the client resubmits every unfinished request with the tokens it already
holds: the engine either finds it live and resends its route, or continues it after those
tokens (for greedy and seeded sampling, the same tokens an undisturbed run gives). A Welcome or
Pong that carries a failure means the engine is dead: every waiting request ends with a 503,
and so does every later one, at once.
"""

from __future__ import annotations

import itertools
import logging
import os
import uuid
from dataclasses import dataclass, field

import msgspec

from pagedserve.actors.messages import (
    ChatMessage,
    DeltaBatch,
    GenerateRequest,
    LoRARequest,
    Pong,
    PoolingParams,
    PromptOptions,
    RequestDelta,
    RequestError,
    SamplingParams,
    SchedulerStats,
    Welcome,
)

logger = logging.getLogger(__name__)

# a text, token ids, chat messages, or a cross-encoder's text pair (GenerateRequest.prompt_pair)
Prompt = str | list[int] | list[ChatMessage] | tuple[str, str]
Event = RequestDelta | RequestError | SchedulerStats

CONNECT_TIMEOUT_S = 10.0  # the engine must answer a new client's Hello within this
PING_INTERVAL_S = 1.0
# An engine silent this long while requests wait is gone. Longer than the supervisor takes to
# find a hung actor and restart it (SupervisionConfig.heartbeat_timeout_s).
LIVENESS_TIMEOUT_S = 45.0


class EngineRequestError(ValueError):
    """The engine refused a request; `status_code` is the HTTP status to use."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.status_code = status_code


class EngineUnavailableError(ConnectionError):
    """No engine answers at the address (never started, stopped or dead)."""


def make_request(
    seq: int,
    prompt: Prompt,
    sampling: SamplingParams,
    options: PromptOptions | None = None,
    priority: int = 0,
    lora: LoRARequest | None = None,
    pooling: PoolingParams | None = None,
) -> GenerateRequest:
    """The request for a prompt; `options`: how the tokenizer makes its ids (None: defaults);
    `priority`: its place with priority scheduling (lower first); `lora`: its adapter;
    `pooling`: an embedding of the prompt instead of output tokens."""
    request = GenerateRequest(
        seq=seq, sampling=sampling, options=options or PromptOptions(), priority=priority,
        lora=lora, pooling=pooling,
    )  # fmt: skip
    if isinstance(prompt, str):
        request.prompt = prompt
    elif isinstance(prompt, tuple):
        request.prompt, request.prompt_pair = prompt
    elif prompt and isinstance(prompt[0], ChatMessage):
        request.messages = prompt  # type: ignore[assignment]
    else:
        request.prompt_token_ids = prompt  # type: ignore[assignment]
    return request


def fan_out(sampling: SamplingParams) -> list[SamplingParams]:
    """n > 1 becomes n engine requests sharing the prompt (and so its cached KV blocks).
    Child i of a seeded request uses seed + i, so each is reproducible on its own."""
    if sampling.n == 1:
        return [sampling]
    return [
        msgspec.structs.replace(
            sampling, n=1, seed=None if sampling.seed is None else sampling.seed + i
        )
        for i in range(sampling.n)
    ]


@dataclass
class TrackedRequest:
    request: GenerateRequest
    label: str
    token_ids: list[int] = field(default_factory=list)  # output tokens received
    text_length: int = 0  # output characters received
    has_prompt: bool = False  # the first delta (with the prompt ids) arrived
    has_prompt_logprobs: bool = False  # the delta with the prompt's logprobs arrived


class ClientCore:
    def __init__(self) -> None:
        self.identity = f"{os.getpid()}-{uuid.uuid4().hex[:12]}".encode()
        self._seqs = itertools.count()
        self.requests: dict[int, TrackedRequest] = {}  # unfinished, by seq
        self.epoch: int | None = None
        self.failure = ""  # why the engine is dead, once it said so

    def next_seq(self) -> int:
        return next(self._seqs)

    def track(
        self,
        prompt: Prompt,
        sampling: SamplingParams,
        label: str | None = None,
        options: PromptOptions | None = None,
        priority: int = 0,
        lora: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
    ) -> GenerateRequest:
        """A new request (labelled `label`, or identity-seq) to send."""
        request = make_request(self.next_seq(), prompt, sampling, options, priority, lora, pooling)
        label = label if label is not None else f"{self.identity.decode()}-{request.seq}"
        self.requests[request.seq] = TrackedRequest(request, label)
        return request

    def forget(self, seq: int) -> None:
        self.requests.pop(seq, None)

    def seqs_labelled(self, labels: list[str]) -> list[int]:
        wanted = set(labels)
        return [seq for seq, t in self.requests.items() if t.label in wanted]

    def on_failure(self, failure: str) -> list[Event]:
        """The engine is dead: a 503 for every waiting request (and for later ones)."""
        self.failure = failure
        errors: list[Event] = [
            RequestError(seq=seq, message=failure, status_code=503) for seq in self.requests
        ]
        self.requests.clear()
        return errors

    def refusal(self, seq: int) -> RequestError | None:
        """A dead engine's 503 for a request about to be sent (which is then not tracked)."""
        if not self.failure:
            return None
        self.forget(seq)
        return RequestError(seq=seq, message=self.failure, status_code=503)

    def on_epoch(self, message: Welcome | Pong) -> list[GenerateRequest]:
        """The requests to resubmit: all unfinished ones when the epoch moved."""
        moved = self.epoch is not None and message.epoch != self.epoch
        self.epoch = message.epoch
        if not moved:
            return []
        logger.warning(
            "the engine restarted an actor; resubmitting %d requests", len(self.requests)
        )
        return [
            msgspec.structs.replace(t.request, resume_token_ids=list(t.token_ids))
            for t in self.requests.values()
        ]

    def events(self, frame: DeltaBatch | RequestError | SchedulerStats) -> list[Event]:
        """The events a frame holds for this client's requests, trimmed to what is new;
        finished requests are forgotten."""
        if isinstance(frame, SchedulerStats):
            return [frame]
        if isinstance(frame, RequestError):
            tracked = self.requests.pop(frame.seq, None)
            return [] if tracked is None else [frame]
        events: list[Event] = []
        for delta in frame.deltas:
            tracked = self.requests.get(delta.seq)
            if tracked is None:
                continue
            fresh = self._trim(delta, tracked)
            if fresh is not None:
                events.append(fresh)
                if fresh.finish_reason is not None:
                    del self.requests[delta.seq]
        return events

    @staticmethod
    def _trim(delta: RequestDelta, tracked: TrackedRequest) -> RequestDelta | None:
        """The part of `delta` this client does not hold yet (None: nothing new)."""
        skip = len(tracked.token_ids) - delta.token_offset
        if skip > 0:
            delta.token_ids = delta.token_ids[skip:]
            if delta.logprobs is not None:
                delta.logprobs = delta.logprobs[skip:]
        skip_text = tracked.text_length - delta.text_offset
        if skip_text > 0:
            delta.text = delta.text[skip_text:]
        if tracked.has_prompt:
            delta.prompt_token_ids = None
        elif delta.prompt_token_ids is not None:
            tracked.has_prompt = True
        if tracked.has_prompt_logprobs:
            delta.prompt_logprobs = None
        elif delta.prompt_logprobs is not None:
            tracked.has_prompt_logprobs = True
        tracked.token_ids += delta.token_ids
        tracked.text_length += len(delta.text)
        delta.request_id = tracked.label
        news = delta.prompt_token_ids is not None or delta.prompt_logprobs is not None
        if not (delta.token_ids or delta.text or news):
            if delta.finish_reason is None:
                return None
        return delta


def merge_delta(pending: RequestDelta, later: RequestDelta) -> None:
    """Fold `later` into `pending`, a delta of the same request its consumer has not taken
    yet: one delta with both's text, tokens and logprobs, that ends where `later` ends."""
    pending.text += later.text
    pending.token_ids.extend(later.token_ids)
    if later.logprobs is not None:
        pending.logprobs = (pending.logprobs or []) + later.logprobs
    if pending.prompt_token_ids is None and later.prompt_token_ids is not None:
        pending.prompt_token_ids = later.prompt_token_ids
        pending.num_cached_tokens = later.num_cached_tokens
    if pending.prompt_logprobs is None:
        pending.prompt_logprobs = later.prompt_logprobs
    if later.embedding is not None:
        pending.embedding = later.embedding
    pending.finish_reason, pending.stop_reason = later.finish_reason, later.stop_reason


def raise_if_error(event: Event | None) -> None:
    if isinstance(event, RequestError):
        raise EngineRequestError(event.message, event.status_code)
