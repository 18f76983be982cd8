"""Token-budget scheduler: continuous batching, chunked prefill, prefix caching, preemption.

The scheduler owns every request's state (token history, sampling settings and RNG key, KV
blocks, route back to the client); workers and the detokenizer cache it, keyed by handle.

No prefill/decode phases: each step, every request's `num_computed_tokens` catches up with the
tokens the worker will know for it, within one token budget; running requests first, then
waiting ones, in queue order (ordering.py: FCFS, or by priority). Plans are diffs against the
worker's persistent batch, made before the previous result arrives (async): requests count
their sampled tokens in flight (`num_inflight`), plans in flight record whom they sample for,
and the worker appends its own samples (pipeline parallelism: layout.plan_capacity). Running
decodes are planned and applied in bulk over counter columns (decode_path.py, columns.py)."""

from __future__ import annotations

import itertools
import random
import sys
from collections import deque
from operator import attrgetter

import msgspec
import numpy as np

from pagedserve.actors.messages import (
    EPOCH_SHIFT,
    AddRequest,
    CachedRequestData,
    FinishReason,
    RequestError,
    RequestOutput,
    Route,
    SchedulerStats,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from pagedserve.actors.scheduler import admission, decode_path, ordering, pooling, speculation
from pagedserve.actors.scheduler.block_manager import BlockManager
from pagedserve.actors.scheduler.columns import RequestColumns
from pagedserve.actors.scheduler.decode_path import StepRecord
from pagedserve.actors.scheduler.request import Request, RequestStatus
from pagedserve.actors.scheduler.routes import RouteTable
from pagedserve.config import EngineConfig
from pagedserve.layout import plan_capacity

_row = attrgetter("row")


class Scheduler:
    def __init__(self, config: EngineConfig, num_kv_blocks: int, epoch: int = 0) -> None:
        self.config = config
        self.block_size = config.block_size
        # A request never outgrows the whole cache, so it can always run alone.
        self.max_len = min(config.max_model_len or sys.maxsize, num_kv_blocks * self.block_size)
        self.max_waiting = config.max_waiting_requests or admission.default_max_waiting(
            config, num_kv_blocks
        )
        self.block_manager = BlockManager(
            num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.requests: dict[int, Request] = {}  # unfinished requests by handle
        self.columns = RequestColumns()  # their counters (one row each)
        self.routes = RouteTable()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # queue order (ordering.py): the last is preempted
        self._running_rows: np.ndarray | None = None  # their rows; None: running changed
        self._steps: dict[int, StepRecord] = {}  # the plans in flight, by step id
        self._record = StepRecord()  # of the plan being made
        self.finished_handles: list[int] = []  # for the worker to drop, sent with the next plan
        self._handles = itertools.count(epoch << EPOCH_SHIFT)
        self._seeds = random.Random(config.seed + (epoch << 32))  # RNG keys of unseeded requests
        self.next_step_id = epoch << EPOCH_SHIFT
        self.reset_workers = True  # the next plan tells the workers to drop what they hold
        self.counters = SchedulerStats(num_total_blocks=num_kv_blocks)
        self.spec = config.speculative_config
        # KV slots a step's proposer writes past the step's tokens (a draft model's decodes)
        self.lookahead = 0 if self.spec is None else self.spec.lookahead_slots
        self._speculate = False  # whether the last plan speculated
        self.pipelined = config.pipeline_parallel_size > 1

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, msg: AddRequest) -> Route | RequestError:
        """Accept a request (its route, for the detokenizer) or refuse it (an error for its
        client). A resubmitted route that is known gets that request's route again."""
        known = self.routes.find((msg.client, msg.seq))
        if known is not None:
            return known
        refusal = admission.refusal(
            msg, self.max_len, self.config, len(self.waiting), self.max_waiting
        )
        if refusal is not None:
            return RequestError(seq=msg.seq, message=refusal[0], status_code=refusal[1],
                                client=msg.client)  # fmt: skip
        seed = msg.sampling.seed if msg.sampling.seed is not None else self._seeds.getrandbits(63)
        request = Request.from_add(msg, next(self._handles), seed, self.columns, self.max_len)
        self.requests[request.handle] = request
        self.routes.add(request)
        ordering.to_waiting(self.waiting, request, self.config, preempted=False)
        if msg.resume_token_ids:  # it may have ended with the tokens its client holds
            reason = request.end_reason(request.token_ids[-1])
            if reason is not None:
                self._finish(request, reason)
        return request.route()

    def abort_requests(self, client: bytes, seqs: list[int]) -> list[RequestOutput]:
        """Finish the client's live requests among `seqs`; their final (abort) outputs."""
        outputs = []
        for seq in seqs:
            req = self.routes.live.get((client, seq))
            if req is not None:
                self._finish(req, FinishReason.ABORT)
                outputs.append(req.output([], None))
        return outputs

    def stop_requests(self, handles: list[int]) -> None:
        """Finish requests whose final message the detokenizer has sent (a stop string)."""
        for handle in handles:
            req = self.requests.get(handle)
            if req is not None:
                self._finish(req, FinishReason.STOP)

    def stats(self) -> SchedulerStats:
        return msgspec.structs.replace(
            self.counters,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_free_blocks=self.block_manager.num_free_blocks,
        )

    # ------------------------------------------------------------------ planning

    def schedule(self) -> StepPlan | None:
        speculate = speculation.speculating(self.config, len(self.running), len(self.waiting))
        if self._speculate and not speculate:  # proposals for steps that will not verify them
            for req in self.running:
                req.draft_token_ids = []
        self._speculate = speculate
        plan = StepPlan(
            step_id=self.next_step_id, cached_requests=CachedRequestData(), propose=speculate
        )
        record = self._record = StepRecord()
        budget = self.config.max_num_batched_tokens
        cap = plan_capacity(self.config, len(self.running) + len(self.waiting))
        planned = None
        spec_in_flight = self.spec is not None and any(r.proposes for r in self._steps.values())
        if self.running and not speculate and not self.pipelined and not spec_in_flight:
            planned = decode_path.plan_running(self, plan, record, budget, cap)
        budget, preempted = planned or self._schedule_running(plan, budget, cap, spec_in_flight)
        if not preempted:  # a step that preempts admits nobody
            self._schedule_waiting(plan, budget, cap)
        if not plan.scheduled:
            return None
        # Cached only now, so that no request in this plan reads KV that this plan writes.
        for req in record.to_cache:
            self.block_manager.cache_full_blocks(req)
        if record.requests:
            record.proposes = plan.propose
            self._steps[plan.step_id] = record.seal(self.columns.handle)
        plan.finished, self.finished_handles = self.finished_handles, []
        plan.reset, self.reset_workers = self.reset_workers, False
        self.next_step_id += 1
        self.counters.num_steps += 1
        return plan

    def running_rows(self) -> np.ndarray:
        """The rows of the running requests, in their order."""
        if self._running_rows is None:
            self._running_rows = np.fromiter(map(_row, self.running), np.intp, len(self.running))
        return self._running_rows

    def _schedule_running(
        self, plan: StepPlan, budget: int, cap: int, spec_in_flight: bool
    ) -> tuple[int, bool]:
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0 and len(plan.scheduled) < cap:
            req = self.running[i]
            i += 1
            if req.num_inflight and (plan.propose or spec_in_flight or self.pipelined):
                # its next drafts, how many tokens its speculative step emits, or (pipeline)
                # its token, come with its result
                continue
            n = self._num_to_schedule(req, budget)
            drafts = []
            if plan.propose:
                drafts = speculation.drafts_to_verify(req, n, budget, self.max_len)
            slots = self._slots(req.num_computed_tokens, n + len(drafts), plan.propose)
            while n and not self.block_manager.can_append(req, slots):
                victim = self.running.pop()  # the newest (or lowest-priority) running request
                self._preempt(victim)
                preempted = True
                if victim is req:
                    return budget, preempted
            if n:
                new_blocks = self.block_manager.append_slots(req, slots)
                self._add_to_plan(plan, req, n + len(drafts), new_blocks, drafts)
                budget -= n + len(drafts)
        return budget, preempted

    def _schedule_waiting(self, plan: StepPlan, budget: int, cap: int) -> None:
        loras = admission.running_loras(self.running) if self.config.enable_lora else set()
        for req in list(self.waiting):
            full = len(self.running) >= self.config.max_num_seqs or len(plan.scheduled) >= cap
            if budget == 0 or full:
                return
            if req.num_inflight:  # preempted with a token in flight: resume it later
                continue
            if req.lora is not None and not admission.lora_fits(req.lora, loras, self.config):
                continue
            hit = pooling.takes_cached_prefix(req, self.config)
            cached = self.block_manager.find_cached_prefix(req) if hit else []
            num_hit = len(cached) * self.block_size
            n = min(req.num_tokens - num_hit, budget)
            slots = num_hit + self._slots(num_hit, n, plan.propose)
            if not self.block_manager.can_allocate(cached, slots):
                return
            self.block_manager.allocate(req, cached, slots)
            req.num_computed_tokens = num_hit
            admission.count(self.counters, req, num_hit, self.config.enable_prefix_caching)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            ordering.to_running(self.running, req, self.config)
            self._running_rows = None
            self._add_to_plan(plan, req, n, [], [])
            budget -= n
            if req.lora is not None:
                loras.add(req.lora)

    def _slots(self, num_computed: int, n: int, speculate: bool) -> int:
        """KV slots past `num_computed` to hold for `n` more tokens: in a step that
        speculates, with the proposer's lookahead, within the most a request may hold."""
        if not (self.lookahead and speculate):
            return n
        return max(n, min(n + self.lookahead, self.max_len - num_computed))

    def _num_to_schedule(self, req: Request, budget: int) -> int:
        """Tokens to compute for `req` now, or 0 where the chunk would sample a token that
        could only land past max_tokens / max_model_len."""
        num_tokens = req.num_tokens_with_inflight
        need = num_tokens - req.num_computed_tokens
        if need > budget:
            return budget
        return need if num_tokens < req.limit else 0

    def _add_to_plan(
        self, plan: StepPlan, req: Request, n: int, new_blocks: list[int], drafts: list[int]
    ) -> None:
        if req.in_worker:
            assert not plan.new_requests, "a plan schedules its cached requests first"
            cached = plan.cached_requests
            cached.num_computed_tokens.append(req.num_computed_tokens)
            cached.num_new_blocks.append(len(new_blocks))
            cached.new_block_ids += new_blocks
            if self.pipelined:
                new_tokens = req.token_ids[req.num_sent_tokens :]
                cached.num_new_tokens.append(len(new_tokens))
                cached.new_token_ids += new_tokens
        else:
            plan.new_requests.append(req.new_request_data())
            req.in_worker = True
        req.num_sent_tokens = req.num_tokens
        plan.scheduled.append(req.handle)
        plan.num_scheduled_tokens.append(n)
        if plan.propose:
            plan.spec_token_ids.append(drafts)
        if self.spec is not None:
            req.draft_token_ids, req.num_drafts_in_flight = [], len(drafts)
        if req.num_computed_tokens + n == req.num_tokens_with_inflight + len(drafts):
            req.num_inflight += 1  # this chunk ends in a sampled token
            self._record.add(req)
        req.num_computed_tokens += n
        self._record.to_cache.append(req)

    def _preempt(self, req: Request) -> None:
        """Recompute later: free the blocks, forget the KV, queue at the front."""
        self.block_manager.deallocate(req)
        self._running_rows = None
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        req.status = RequestStatus.WAITING
        ordering.to_waiting(self.waiting, req, self.config, preempted=True)
        self._drop_from_worker(req)
        self.counters.num_preemptions += 1

    def forget_workers(self) -> None:
        """The workers are being restarted: their batches and KV cache are gone. Every
        running request goes back to waiting (a preemption: recomputed from its tokens so
        far), tokens in flight are forgotten, and so is the prefix cache."""
        while self.running:
            self._preempt(self.running.pop())
        self._steps.clear()
        self.columns.num_inflight[:] = 0
        for req in self.requests.values():
            req.in_worker = False
            req.num_drafts_in_flight = 0
        self.finished_handles = []
        self.block_manager.forget_cached_blocks()
        self.reset_workers = True

    # ------------------------------------------------------------------ results

    def update_from_result(self, result: StepResult) -> list[RequestOutput]:
        for chunk in result.prompt_logprobs:
            if chunk.handle in self.requests:
                self.requests[chunk.handle].add_prompt_logprobs(chunk.start, chunk.logprobs)
        record = self._steps.pop(result.step_id, None)
        if record is None:  # a step not in flight (lost, or another scheduler's)
            return []
        outputs = decode_path.apply_result(self, record, result)
        if outputs is None:
            outputs = self._apply_tokens(record, result)
        if result.pooled:
            outputs += pooling.finish_pooled(self, record, result.pooled)
        return outputs

    def _apply_tokens(self, record: StepRecord, result: StepResult) -> list[RequestOutput]:
        """Each request's tokens of a step, in turn."""
        outputs = []
        counts = result.num_sampled or [1] * len(result.handles)
        logprobs = result.logprobs or [None] * len(result.sampled_token_ids)
        sampling = dict(zip(record.handles, record.requests))  # the requests the step samples
        grammar_done = set(result.grammar_done)
        start = verify_start = 0
        for i, (handle, count) in enumerate(zip(result.handles, counts)):
            tokens = result.sampled_token_ids[start : start + count]
            token_logprobs = logprobs[start : start + count]
            start += count
            req = sampling.pop(handle, None)
            first_verify = verify_start
            verify_start += result.num_verifies[i] if result.num_verifies else 0
            if req is None or req.status is RequestStatus.FINISHED:
                continue  # finished or aborted meanwhile (or a handle the step did not sample)
            req.num_inflight -= 1
            verifies = speculation.verifies_of(
                result, i, first_verify, req.num_drafts_in_flight, count
            )
            if req.num_drafts_in_flight or len(verifies) > 1:
                self._roll_back_drafts(req, count)
            output = self._append_tokens(req, tokens, token_logprobs, handle in grammar_done)
            speculation.count_verifies(self.counters, verifies, len(output.new_token_ids))
            outputs.append(output)
            if result.draft_token_ids and self._takes_proposals(req):
                req.draft_token_ids = result.draft_token_ids[i]
        return outputs

    def _append_tokens(
        self, req: Request, tokens: list[int], logprobs: list[TokenLogprobs | None], done: bool
    ) -> RequestOutput:
        """A step's tokens for `req` (one, or with speculation the accepted drafts and one
        more), up to the first that finishes it; `done`: they complete its structured output
        (the worker's grammar), which finishes it (stop)."""
        kept: list[int] = []
        for token in tokens:
            req.token_ids.append(token)
            kept.append(token)
            self.counters.num_generation_tokens += 1
            reason = req.end_reason(token)
            if reason is not None:
                self._finish(req, reason)
                break
        if done and req.status is not RequestStatus.FINISHED:
            self._finish(req, FinishReason.STOP)
        if req.status is RequestStatus.RUNNING:
            self.block_manager.cache_full_blocks(req)  # the tokens may complete a block
        use_lp = req.sampling.logprobs is not None and all(lp is not None for lp in logprobs)
        return req.output(kept, logprobs[: len(kept)] if use_lp else None)  # type: ignore[arg-type]

    def _takes_proposals(self, req: Request) -> bool:
        """Whether its proposals from a result are for its next plan: it runs, no plan has
        scheduled it since (that step emits the token they would follow), and steps
        speculate."""
        return req.status is RequestStatus.RUNNING and not req.num_inflight and self._speculate

    def _roll_back_drafts(self, req: Request, emitted: int) -> None:
        """The KV of its rejected drafts: every emitted token but the last is computed."""
        drafts, req.num_drafts_in_flight = req.num_drafts_in_flight, 0
        if req.status is RequestStatus.RUNNING:
            req.num_computed_tokens -= drafts - (emitted - 1)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.block_manager.deallocate(req)
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._running_rows = None
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.release()
        del self.requests[req.handle]
        self.routes.finish(req)
        self._drop_from_worker(req)

    def _drop_from_worker(self, req: Request) -> None:
        if req.in_worker:
            self.finished_handles.append(req.handle)
            req.in_worker = False
