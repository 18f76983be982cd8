"""Scheduler-side state of one request: the one owner of its token history.

Its counters that every step advances (`num_computed_tokens`, `num_inflight`) live in a row of
the scheduler's `RequestColumns` (columns.py), which own them; the properties here read and
write that row."""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field

from pagedserve.actors.messages import (
    AddRequest,
    FinishReason,
    LoRARequest,
    NewRequestData,
    PoolingParams,
    RequestOutput,
    Route,
    SamplingParams,
    TokenLogprobs,
)
from pagedserve.actors.scheduler.columns import RequestColumns


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
    columns: RequestColumns  # its row there (`row`) holds its counters while it is unfinished
    row: int
    arrival_time: float = 0.0
    priority: int = 0  # scheduling_policy "priority": lower goes first
    lora: LoRARequest | None = None  # the adapter it runs with (enable_lora)
    status: RequestStatus = RequestStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks of `token_ids` (content only; survives preemption).
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks of block_table already in the prefix cache
    in_worker: bool = False  # the worker holds it in its persistent batch
    # pipeline parallelism (kept there only): of token_ids, those the workers were sent
    num_sent_tokens: int = 0
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
    # an embedding (PoolingParams): it computes its prompt and ends with the pooled vector
    # (`pooled`, from the worker's result), never sampling a token (scheduler/pooling.py)
    pooling: PoolingParams | None = None
    pooled: bytes | None = None

    @classmethod
    def from_add(
        cls,
        msg: AddRequest,
        handle: int,
        seed: int,
        columns: RequestColumns | None = None,
        max_len: int = sys.maxsize,
    ) -> Request:
        """The request, with a row in `columns` (a table of its own when none is given).
        `max_len`: the most tokens it may hold (it ends by length there)."""
        eos = frozenset() if msg.sampling.ignore_eos else frozenset(msg.eos_token_ids)
        columns = columns if columns is not None else RequestColumns(capacity=1)
        max_tokens = msg.sampling.max_tokens
        limit = (
            max_len if max_tokens is None else min(len(msg.prompt_token_ids) + max_tokens, max_len)
        )
        if msg.pooling is not None:  # its one "token" (the vector) is never scheduled past
            limit = len(msg.prompt_token_ids) + 1
        request = cls(
            handle=handle,
            client=msg.client,
            seq=msg.seq,
            token_ids=[*msg.prompt_token_ids, *msg.resume_token_ids],
            num_prompt_tokens=len(msg.prompt_token_ids),
            sampling=msg.sampling,
            seed=seed,
            eos_token_ids=eos,
            columns=columns,
            row=-1,
            arrival_time=msg.arrival_time,
            priority=msg.priority,
            lora=msg.lora,
            prompt_logprobs=[] if msg.sampling.prompt_logprobs is None else [None],
            pooling=msg.pooling,
        )
        wants_prompt_logprobs = msg.sampling.prompt_logprobs is not None
        request.row = columns.add(
            handle, request.num_prompt_tokens, limit, request.stop_tokens, wants_prompt_logprobs
        )
        return request

    def new_request_data(self) -> NewRequestData:
        """What a worker that does not hold it gets of it (the plan's wire form)."""
        return NewRequestData(
            self.handle, list(self.token_ids), self.num_prompt_tokens, self.sampling, self.seed,
            list(self.block_table), self.num_computed_tokens, self.lora, self.pooling,
        )  # fmt: skip

    @property
    def hash_root(self) -> bytes:
        """The parent of its first block's hash: prompts under different adapters (or none)
        share no KV in the prefix cache."""
        lora = self.lora
        return b"" if lora is None else f"lora:{lora.lora_int_id}:{lora.lora_path}".encode()

    def release(self) -> None:
        """It finished: give its row back (its counters read 0 from now on)."""
        self.columns.release(self.row, self.stop_tokens)
        self.row = -1

    @property
    def stop_tokens(self) -> frozenset[int]:
        """The tokens that end it once it has min_tokens (EOS unless ignored, stop ids)."""
        return self.eos_token_ids | frozenset(self.sampling.stop_token_ids or ())

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is computed or scheduled to be (advanced when a plan is made)."""
        return int(self.columns.num_computed[self.row]) if self.row >= 0 else 0

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        assert self.row >= 0, "a finished request computes nothing"
        self.columns.num_computed[self.row] = value

    @property
    def num_inflight(self) -> int:
        """Plans in flight that will sample a token for it."""
        return int(self.columns.num_inflight[self.row]) if self.row >= 0 else 0

    @num_inflight.setter
    def num_inflight(self, value: int) -> None:
        assert self.row >= 0, "a finished request has no step in flight"
        self.columns.num_inflight[self.row] = value

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
        return len(self.token_ids) + self.num_inflight

    @property
    def limit(self) -> int:
        """Its length when it ends by length (max_tokens, or the most a request may hold)."""
        return int(self.columns.limit[self.row])

    def end_reason(self, token: int) -> FinishReason | None:
        """Why it ends with `token`, its newest (None: it goes on); a stop token id is kept
        as its stop_reason."""
        num_output = len(self.token_ids) - self.num_prompt_tokens
        if num_output >= self.sampling.min_tokens:
            if token in self.eos_token_ids:
                return FinishReason.STOP
            stop_token_ids = self.sampling.stop_token_ids
            if stop_token_ids and token in stop_token_ids:
                self.stop_reason = token
                return FinishReason.STOP
        return FinishReason.LENGTH if len(self.token_ids) >= self.limit else None

    def output(
        self, new_token_ids: list[int], logprobs: list[TokenLogprobs] | None
    ) -> RequestOutput:
        """Its output for the detokenizer: these new tokens (the last ones of `token_ids`),
        where they start in the output, and how it ended if it did."""
        offset = self.num_output_tokens - len(new_token_ids)
        return RequestOutput(
            self.handle, new_token_ids, logprobs, self.finish_reason, self.stop_reason,
            max(self.num_cached_tokens, 0), offset, self.take_prompt_logprobs(), self.pooled,
        )  # fmt: skip

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
            self.pooled,
        )
