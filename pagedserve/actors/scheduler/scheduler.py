"""Token-budget scheduler: continuous batching, chunked prefill, prefix caching, preemption.

The scheduler owns every request's state: its token history, its sampling settings and RNG key,
its KV blocks and its route back to the client. Workers and the detokenizer hold caches of it,
keyed by the request's handle.

There are no prefill/decode phases: every step, each request's `num_computed_tokens` catches
up with the tokens the worker will know for it, within one token budget. Running requests go
first (in order), then waiting ones (FCFS). Plans are diffs against the worker's persistent
batch. Scheduling is asynchronous: a plan may be made before the previous plan's result
arrives, so each request counts the sampled tokens still in flight (`inflight_steps`); the
worker appends its own sampled tokens, so it knows them when it runs the next plan.
"""

from __future__ import annotations

import itertools
import random
import sys
from collections import deque

import msgspec

from pagedserve.actors.messages import (
    EPOCH_SHIFT,
    AddRequest,
    CachedRequestData,
    FinishReason,
    NewRequestData,
    RequestError,
    RequestOutput,
    Route,
    SchedulerStats,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from pagedserve.actors.scheduler.block_manager import BlockManager
from pagedserve.actors.scheduler.request import Request, RequestStatus
from pagedserve.actors.scheduler.routes import RouteTable
from pagedserve.config import EngineConfig


class Scheduler:
    def __init__(self, config: EngineConfig, num_kv_blocks: int, epoch: int = 0) -> None:
        self.config = config
        self.block_size = config.block_size
        # A request never outgrows the whole cache, so it can always run alone.
        self.max_len = min(config.max_model_len or sys.maxsize, num_kv_blocks * self.block_size)
        self.max_waiting = config.max_waiting_requests or default_max_waiting(config, num_kv_blocks)
        self.block_manager = BlockManager(
            num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.requests: dict[int, Request] = {}  # unfinished requests by handle
        self.routes = RouteTable()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is the newest
        self.finished_handles: list[int] = []  # for the worker to drop, sent with the next plan
        self._handles = itertools.count(epoch << EPOCH_SHIFT)
        self._seeds = random.Random(config.seed + (epoch << 32))  # RNG keys of unseeded requests
        self.next_step_id = epoch << EPOCH_SHIFT
        self.reset_workers = True  # the next plan tells the workers to drop what they hold
        self.counters = SchedulerStats(num_total_blocks=num_kv_blocks)

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, msg: AddRequest) -> Route | RequestError:
        """Accept a request (its route, for the detokenizer) or refuse it (an error for its
        client). A resubmitted route that is known gets that request's route again."""
        known = self.routes.find((msg.client, msg.seq))
        if known is not None:
            return known.route()
        refusal = self._refusal(msg)
        if refusal is not None:
            return RequestError(seq=msg.seq, message=refusal[0], status_code=refusal[1],
                                client=msg.client)  # fmt: skip
        seed = msg.sampling.seed if msg.sampling.seed is not None else self._seeds.getrandbits(63)
        request = Request.from_add(msg, next(self._handles), seed)
        self.requests[request.handle] = request
        self.routes.add(request)
        self.waiting.append(request)
        if msg.resume_token_ids:  # it may have ended with the tokens its client holds
            reason = self._check_stop(request, request.token_ids[-1])
            if reason is not None:
                self._finish(request, reason)
        return request.route()

    def _refusal(self, msg: AddRequest) -> tuple[str, int] | None:
        """Why a request cannot be accepted (message, HTTP status), or None."""
        num_tokens = len(msg.prompt_token_ids) + len(msg.resume_token_ids)
        if not msg.prompt_token_ids:
            return "the prompt is empty", 400
        if num_tokens >= self.max_len:
            limit = (
                f"This model's maximum context length is {self.max_len} tokens"
                if self.max_len == self.config.max_model_len
                else f"The KV cache holds at most {self.max_len} tokens of one request"
            )
            return (
                f"{limit}; the prompt has {num_tokens} tokens, which leaves no room for output.",
                400,
            )
        if len(self.waiting) >= self.max_waiting:
            return (
                f"the engine is overloaded ({len(self.waiting)} requests waiting); retry later",
                503,
            )
        return None

    def abort_requests(self, client: bytes, seqs: list[int]) -> list[RequestOutput]:
        """Finish the client's live requests among `seqs`; their final (abort) outputs."""
        outputs = []
        for seq in seqs:
            req = self.routes.live.get((client, seq))
            if req is not None:
                self._finish(req, FinishReason.ABORT)
                outputs.append(self._output(req, [], None))
        return outputs

    def stop_requests(self, handles: list[int]) -> None:
        """Finish requests whose final message the detokenizer has sent (a stop string)."""
        for handle in handles:
            req = self.requests.get(handle)
            if req is not None:
                self._finish(req, FinishReason.STOP)

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
        if not plan.scheduled:
            return None
        # Cached only now, so that no request in this plan reads KV that this plan writes.
        for handle in plan.scheduled:
            self.block_manager.cache_full_blocks(self.requests[handle])
        plan.finished, self.finished_handles = self.finished_handles, []
        plan.reset, self.reset_workers = self.reset_workers, False
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
        num_tokens = len(req.token_ids) + len(req.inflight_steps)
        need = num_tokens - req.num_computed_tokens
        if need > budget:
            return budget
        max_tokens = req.sampling.max_tokens
        if max_tokens is not None and num_tokens - req.num_prompt_tokens >= max_tokens:
            return 0
        return need if num_tokens < self.max_len else 0

    def _add_to_plan(self, plan: StepPlan, req: Request, n: int, new_blocks: list[int]) -> None:
        if req.in_worker:
            cached = plan.cached_requests
            cached.handles.append(req.handle)
            cached.new_block_ids.append(new_blocks)
            cached.num_computed_tokens.append(req.num_computed_tokens)
        else:
            plan.new_requests.append(
                NewRequestData(
                    req.handle,
                    list(req.token_ids),
                    req.num_prompt_tokens,
                    req.sampling,
                    req.seed,
                    list(req.block_table),
                    req.num_computed_tokens,
                )
            )
            req.in_worker = True
        plan.scheduled.append(req.handle)
        plan.num_scheduled_tokens.append(n)
        inflight = req.inflight_steps
        if req.num_computed_tokens + n == len(req.token_ids) + len(inflight):
            inflight.append(plan.step_id)  # this chunk ends in a sampled token
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

    def forget_workers(self) -> None:
        """The workers are being restarted: their batches and KV cache are gone. Every
        running request goes back to waiting (a preemption: recomputed from its tokens so
        far), tokens in flight are forgotten, and so is the prefix cache."""
        while self.running:
            self._preempt(self.running.pop())
        for req in self.requests.values():
            req.inflight_steps.clear()
            req.in_worker = False
        self.finished_handles = []
        self.block_manager.forget_cached_blocks()
        self.reset_workers = True

    # ------------------------------------------------------------------ results

    def update_from_result(self, result: StepResult) -> list[RequestOutput]:
        outputs = []
        logprobs = result.logprobs or [None] * len(result.handles)
        find, step_id = self.requests.get, result.step_id
        for handle, token, lp in zip(result.handles, result.sampled_token_ids, logprobs):
            req = find(handle)
            if req is None or not req.inflight_steps or req.inflight_steps[0] != step_id:
                continue  # finished or aborted meanwhile (or a stale id)
            req.inflight_steps.popleft()
            req.token_ids.append(token)
            reason = self._check_stop(req, token)
            if reason is not None:
                self._finish(req, reason)
            elif req.status is RequestStatus.RUNNING:
                self.block_manager.cache_full_blocks(req)  # the token may complete a block
            use_lp = lp is not None and req.sampling.logprobs is not None
            outputs.append(self._output(req, [token], [lp] if use_lp else None))
        self.counters.num_generation_tokens += len(outputs)
        return outputs

    def _check_stop(self, req: Request, token: int) -> FinishReason | None:
        sampling = req.sampling
        num_tokens = len(req.token_ids)
        num_output = num_tokens - req.num_prompt_tokens
        if num_output >= sampling.min_tokens:
            if token in req.eos_token_ids:
                return FinishReason.STOP
            if sampling.stop_token_ids and token in sampling.stop_token_ids:
                req.stop_reason = token
                return FinishReason.STOP
        max_tokens = sampling.max_tokens
        if max_tokens is not None and num_output >= max_tokens:
            return FinishReason.LENGTH
        if num_tokens >= self.max_len:
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
        del self.requests[req.handle]
        self.routes.finish(req)
        self._drop_from_worker(req)

    def _drop_from_worker(self, req: Request) -> None:
        if req.in_worker:
            self.finished_handles.append(req.handle)
            req.in_worker = False

    def _output(
        self, req: Request, new_token_ids: list[int], logprobs: list[TokenLogprobs] | None
    ) -> RequestOutput:
        return RequestOutput(
            req.handle,
            new_token_ids,
            logprobs,
            req.finish_reason,
            req.stop_reason,
            max(req.num_cached_tokens, 0),
        )


def default_max_waiting(config: EngineConfig, num_kv_blocks: int) -> int:
    """Requests allowed to wait: enough to refill the running set several times over, scaled
    with the KV cache (a cache that holds more requests drains a longer queue as fast)."""
    tokens_per_request = min(config.max_model_len or 1024, 1024)
    return max(4 * config.max_num_seqs, 2 * num_kv_blocks * config.block_size // tokens_per_request)
