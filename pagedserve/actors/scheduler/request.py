"""Scheduler-side state of one request."""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from pagedserve.actors.messages import AddRequest, FinishReason, SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0  # queued, or preempted: holds no KV blocks
    RUNNING = 1  # holds KV blocks; the worker has it in its persistent batch
    FINISHED = 2


@dataclass(eq=False)
class Request:
    request_id: str
    token_ids: list[int]  # the prompt, then every output token the scheduler knows
    num_prompt_tokens: int
    sampling: SamplingParams
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
    num_cached_tokens: int = -1  # prompt tokens hit in the prefix cache; -1: never scheduled
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None

    @classmethod
    def from_add(cls, msg: AddRequest) -> Request:
        eos = frozenset() if msg.sampling.ignore_eos else frozenset(msg.eos_token_ids)
        return cls(
            request_id=msg.request_id,
            token_ids=list(msg.prompt_token_ids),
            num_prompt_tokens=len(msg.prompt_token_ids),
            sampling=msg.sampling,
            eos_token_ids=eos,
            arrival_time=msg.arrival_time,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_inflight(self) -> int:
        return len(self.inflight_steps)

    @property
    def num_tokens_with_inflight(self) -> int:
        """The tokens the worker will know when it runs the next plan."""
        return len(self.token_ids) + len(self.inflight_steps)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
