"""Token-budget scheduler: continuous batching, chunked prefill, prefix caching, preemption.

There are no prefill/decode phases: every step, each request's `num_computed_tokens` catches
up with the tokens the worker will know for it, within one token budget. Running requests go
first (in order), then waiting ones (FCFS). Plans are diffs against the worker's persistent
batch. Scheduling is asynchronous: a plan may be made before the previous plan's result
arrives, so each request counts the sampled tokens still in flight (`inflight_steps`); the
worker appends its own sampled tokens, so it knows them when it runs the next plan.
"""

from __future__ import annotations

import sys
from collections import deque

import msgspec

from pagedserve.actors.messages import (
    AddRequest,
    CachedRequestData,
    FinishReason,
    NewRequestData,
    RequestOutput,
    SchedulerStats,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from pagedserve.actors.scheduler.block_manager import BlockManager
from pagedserve.actors.scheduler.request import Request, RequestStatus
from pagedserve.config import EngineConfig


class Scheduler:
    def __init__(self, config: EngineConfig, num_kv_blocks: int) -> None:
        self.config = config
        self.block_size = config.block_size
        # A request never outgrows the whole cache, so it can always run alone.
        self.max_len = min(config.max_model_len or sys.maxsize, num_kv_blocks * self.block_size)
        self.block_manager = BlockManager(
            num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}  # unfinished requests
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is the newest
        self.finished_ids: list[str] = []  # for the worker to drop, sent with the next plan
        self.next_step_id = 0
        self.counters = SchedulerStats(num_total_blocks=num_kv_blocks)

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, req: AddRequest) -> None:
        num_tokens = len(req.prompt_token_ids)
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if num_tokens == 0:
            raise ValueError("the prompt is empty")
        if num_tokens >= self.max_len:
            raise ValueError(
                f"the prompt has {num_tokens} tokens; it must be shorter than {self.max_len} "
                "(max_model_len, or the KV cache capacity) to leave room for output"
            )
        request = Request.from_add(req)
        self.requests[req.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is not None:
                self._finish(req, FinishReason.ABORT)
                outputs.append(self._output(req, [], None))
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStats:
        return msgspec.structs.replace(
            self.counters,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_free_blocks=self.block_manager.num_free_blocks,
        )

    # ------------------------------------------------------------------ planning

    def schedule(self) -> StepPlan | None:
        plan = StepPlan(step_id=self.next_step_id, cached_requests=CachedRequestData([], [], []))
        budget, preempted = self._schedule_running(plan, self.config.max_num_batched_tokens)
        if not preempted:  # a step that preempts admits nobody
            self._schedule_waiting(plan, budget)
        if not plan.scheduled_ids:
            return None
        # Cached only now, so that no request in this plan reads KV that this plan writes.
        for request_id in plan.scheduled_ids:
            self.block_manager.cache_full_blocks(self.requests[request_id])
        plan.finished_ids, self.finished_ids = self.finished_ids, []
        self.next_step_id += 1
        self.counters.num_steps += 1
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int) -> tuple[int, bool]:
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_to_schedule(req, budget)
            while n and not self.block_manager.can_append(req, n):
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                preempted = True
                if victim is req:
                    return budget, preempted
            if n:
                self._add_to_plan(plan, req, n, self.block_manager.append_slots(req, n))
                budget -= n
            i += 1
        return budget, preempted

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        for req in list(self.waiting):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if req.inflight_steps:  # preempted with a token in flight: resume it later
                continue
            cached = self.block_manager.find_cached_prefix(req)
            num_hit = len(cached) * self.block_size
            n = min(req.num_tokens - num_hit, budget)
            if not self.block_manager.can_allocate(cached, num_hit + n):
                return
            self.block_manager.allocate(req, cached, num_hit + n)
            req.num_computed_tokens = num_hit
            self._count_admission(req, num_hit)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add_to_plan(plan, req, n, [])
            budget -= n

    def _num_to_schedule(self, req: Request, budget: int) -> int:
        """Tokens to compute for `req` now, or 0 where the chunk would sample a token that
        could only land past max_tokens / max_model_len."""
        need = req.num_tokens_with_inflight - req.num_computed_tokens
        n = min(need, budget)
        if n == need and not self._can_sample(req):
            return 0
        return n

    def _can_sample(self, req: Request) -> bool:
        num_tokens = req.num_tokens_with_inflight
        max_tokens = req.sampling.max_tokens
        if max_tokens is not None and num_tokens - req.num_prompt_tokens >= max_tokens:
            return False
        return num_tokens < self.max_len

    def _add_to_plan(self, plan: StepPlan, req: Request, n: int, new_blocks: list[int]) -> None:
        if req.in_worker:
            cached = plan.cached_requests
            cached.request_ids.append(req.request_id)
            cached.new_block_ids.append(new_blocks)
            cached.num_computed_tokens.append(req.num_computed_tokens)
        else:
            plan.new_requests.append(
                NewRequestData(
                    req.request_id,
                    list(req.token_ids),
                    req.sampling,
                    list(req.block_table),
                    req.num_computed_tokens,
                )
            )
            req.in_worker = True
        plan.scheduled_ids.append(req.request_id)
        plan.num_scheduled_tokens.append(n)
        if req.num_computed_tokens + n == req.num_tokens_with_inflight:
            req.inflight_steps.append(plan.step_id)  # this chunk ends in a sampled token
        req.num_computed_tokens += n

    def _count_admission(self, req: Request, num_hit: int) -> None:
        if self.config.enable_prefix_caching:
            self.counters.prefix_cache_queries += req.num_tokens
            self.counters.prefix_cache_hits += num_hit
        if req.num_cached_tokens < 0:  # first time scheduled
            req.num_cached_tokens = num_hit
            self.counters.num_prompt_tokens += req.num_prompt_tokens

    def _preempt(self, req: Request) -> None:
        """Recompute later: free the blocks, forget the KV, queue at the front."""
        self.block_manager.deallocate(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self._drop_from_worker(req)
        self.counters.num_preemptions += 1

    # ------------------------------------------------------------------ results

    def update_from_result(self, result: StepResult) -> list[RequestOutput]:
        outputs = []
        logprobs = result.logprobs or [None] * len(result.request_ids)
        for request_id, token, lp in zip(result.request_ids, result.sampled_token_ids, logprobs):
            req = self.requests.get(request_id)
            if req is None or not req.inflight_steps or req.inflight_steps[0] != result.step_id:
                continue  # finished or aborted meanwhile (or a stale id)
            req.inflight_steps.popleft()
            req.token_ids.append(token)
            self.counters.num_generation_tokens += 1
            reason = self._check_stop(req, token)
            if reason is not None:
                self._finish(req, reason)
            elif req.status is RequestStatus.RUNNING:
                self.block_manager.cache_full_blocks(req)  # the token may complete a block
            use_lp = lp is not None and req.sampling.logprobs is not None
            outputs.append(self._output(req, [token], [lp] if use_lp else None))
        return outputs

    def _check_stop(self, req: Request, token: int) -> FinishReason | None:
        sampling = req.sampling
        if req.num_output_tokens >= sampling.min_tokens:
            if token in req.eos_token_ids:
                return FinishReason.STOP
            if sampling.stop_token_ids and token in sampling.stop_token_ids:
                req.stop_reason = token
                return FinishReason.STOP
        max_tokens = sampling.max_tokens
        if max_tokens is not None and req.num_output_tokens >= max_tokens:
            return FinishReason.LENGTH
        if req.num_tokens >= self.max_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.block_manager.deallocate(req)
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        self._drop_from_worker(req)

    def _drop_from_worker(self, req: Request) -> None:
        if req.in_worker:
            self.finished_ids.append(req.request_id)
            req.in_worker = False

    def _output(
        self, req: Request, new_token_ids: list[int], logprobs: list[TokenLogprobs] | None
    ) -> RequestOutput:
        return RequestOutput(
            req.request_id,
            new_token_ids,
            logprobs,
            req.finish_reason,
            req.stop_reason,
            max(req.num_cached_tokens, 0),
        )
