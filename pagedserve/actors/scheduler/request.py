"""Scheduler-side state of one request: the one owner of its token history."""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from pagedserve.actors.messages import (
    AddRequest,
    FinishReason,
    Route,
    SamplingParams,
    TokenLogprobs,
)


class RequestStatus(enum.IntEnum):
    WAITING = 0  # queued, or preempted: holds no KV blocks
    RUNNING = 1  # holds KV blocks; the worker has it in its persistent batch
    FINISHED = 2


@dataclass(eq=False)
class Request:
    handle: int  # assigned once by the scheduler, never reused
    client: bytes  # the route back to the client: its identity and its number for the request
    seq: int
    token_ids: list[int]  # the prompt, then every output token the scheduler knows
    num_prompt_tokens: int
    sampling: SamplingParams
    seed: int  # key of the request's counter-based RNG (see worker/sampler.py)
    eos_token_ids: frozenset[int]
    arrival_time: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    # Tokens whose KV is computed or scheduled to be (advanced when a plan is made).
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks of `token_ids` (content only; survives preemption).
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks of block_table already in the prefix cache
    # Step ids of the plans in flight that will sample a token for this request, oldest first.
    inflight_steps: deque[int] = field(default_factory=deque)
    in_worker: bool = False  # the worker holds it in its persistent batch
    num_sent_tokens: int = 0  # pipeline parallelism: of token_ids, those the workers were sent
    num_cached_tokens: int = -1  # prompt tokens hit in the prefix cache; -1: never scheduled
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    # speculative decoding: the workers' proposals for the next step, and the drafts the
    # step in flight verifies (num_computed_tokens counts them until the result says)
    draft_token_ids: list[int] = field(default_factory=list)
    num_drafts_in_flight: int = 0
    # SamplingParams.prompt_logprobs: the prompt's logprobs so far (one per token from the
    # first, which has None), until they go out with the first output; [] when not wanted.
    # While it holds any, the request skips the prefix cache (every position needs logits).
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)

    @classmethod
    def from_add(cls, msg: AddRequest, handle: int, seed: int) -> Request:
        eos = frozenset() if msg.sampling.ignore_eos else frozenset(msg.eos_token_ids)
        return cls(
            handle=handle,
            client=msg.client,
            seq=msg.seq,
            token_ids=[*msg.prompt_token_ids, *msg.resume_token_ids],
            num_prompt_tokens=len(msg.prompt_token_ids),
            sampling=msg.sampling,
            seed=seed,
            eos_token_ids=eos,
            arrival_time=msg.arrival_time,
            prompt_logprobs=[] if msg.sampling.prompt_logprobs is None else [None],
        )

    @property
    def route_key(self) -> tuple[bytes, int]:
        return self.client, self.seq

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens_with_inflight(self) -> int:
        """The tokens the worker will know when it runs the next plan."""
        return len(self.token_ids) + len(self.inflight_steps)

    def add_prompt_logprobs(self, start: int, logprobs: list[TokenLogprobs]) -> None:
        """Logprobs of prompt tokens start, start + 1, ...: the ones not held yet (a request
        recomputed after preemption computes them again; once sent, none are held)."""
        held = len(self.prompt_logprobs)
        if 0 < held < self.num_prompt_tokens and start <= held < start + len(logprobs):
            self.prompt_logprobs += logprobs[held - start :]

    def take_prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        """The prompt's logprobs once all are known (the first output), then never again."""
        if not self.prompt_logprobs or len(self.prompt_logprobs) < self.num_prompt_tokens:
            return None
        taken, self.prompt_logprobs = self.prompt_logprobs, []
        return taken

    def route(self) -> Route:
        """The detokenizer's view of the request, with every output token so far."""
        return Route(
            self.handle,
            self.client,
            self.seq,
            self.token_ids[: self.num_prompt_tokens],
            self.sampling,
            self.token_ids[self.num_prompt_tokens :],
            self.finish_reason,
            self.stop_reason,
        )
