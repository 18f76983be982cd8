"""The scheduler's columnar fast path: a step's running requests planned, and a step's result
applied, in a few numpy operations over their rows (columns.py) instead of a Python loop of
checks per request, which is what bounds a step at hundreds of running requests.

Planning: each running request's tokens to compute (`need`) come from its row and the length
of its token list; a request needs a new KV block only when its chunk crosses a block boundary
(its block table always covers its computed tokens), so only those few go to the block manager,
in one call. The fast path plans the running set only when the whole set fits the step (token
budget, request cap, free blocks) without speculative decoding or pipeline parallelism;
otherwise, and before it has changed anything, it hands the step to the scheduler's loop
(preemption, chunking, drafts).

Results: a result of one token (and its logprobs, if any) for each request its plan
recorded, in the recorded order (no drafts, prompt logprobs, grammar or pooled vectors), is
applied in bulk; only the requests that can end this step (their length reaches their limit,
or the token is some live request's stop token) go through the exact stop check
(Request.end_reason), and only those whose new token completes a computed block through the
prefix cache. Any other result takes the scheduler's loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np

from pagedserve.actors.messages import RequestOutput, StepPlan, StepResult
from pagedserve.actors.scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagedserve.actors.scheduler.scheduler import Scheduler

_token_ids = attrgetter("token_ids")
_row = attrgetter("row")
_num_cached_tokens = attrgetter("num_cached_tokens")


@dataclass
class StepRecord:
    """A plan in flight: the requests it samples a token for, in batch order (the order of its
    result), their rows, and the handles in those rows then (a row whose handle has changed
    since belongs to a request that finished meanwhile)."""

    requests: list[Request] = field(default_factory=list)
    handles: list[int] = field(default_factory=list)
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.intp))
    row_handles: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    to_cache: list[Request] = field(default_factory=list)  # while planning: see schedule()
    proposes: bool = False  # the plan speculates (its tokens per request are not known)

    def add(self, req: Request) -> None:
        self.requests.append(req)
        self.handles.append(req.handle)

    def seal(self, row_handles: np.ndarray) -> StepRecord:
        """Done planning: the rows of every recorded request (those the fast path planned
        come first and have theirs already)."""
        if len(self.rows) < len(self.requests):
            rest = self.requests[len(self.rows) :]
            self.rows = np.concatenate(
                [self.rows, np.fromiter(map(_row, rest), np.intp, len(rest))]
            )
        self.row_handles = row_handles[self.rows]
        self.to_cache = []
        return self


def plan_running(sched: Scheduler, plan: StepPlan, record: StepRecord, budget: int, cap: int
                 ) -> tuple[int, bool] | None:  # fmt: skip
    """Plan every running request that has tokens to compute: the budget left and whether it
    preempted (never), as the scheduler's loop; None (and nothing changed) when the step is
    not one for the fast path."""
    running, cols = sched.running, sched.columns
    rows = sched.running_rows()
    computed = cols.num_computed[rows]
    lengths = np.fromiter(map(len, map(_token_ids, running)), np.int64, len(running))
    need = lengths + cols.num_inflight[rows] - computed
    done = need + computed >= cols.limit[rows]  # its last token is in flight: nothing to do
    n = np.where(done, 0, need)
    total = int(n.sum())
    picked = np.flatnonzero(n)
    if total > budget or len(picked) > cap or (n < 0).any():
        return None
    if done.any() and int(need[done].max()) > budget - total:  # the loop would chunk it
        return None
    reqs = list(running)
    if len(picked) < len(running):
        reqs = [reqs[i] for i in picked.tolist()]
        rows, computed, n, lengths = rows[picked], computed[picked], n[picked], lengths[picked]
    end = computed + n
    new_blocks = _grow_block_tables(sched, reqs, computed, n)
    if new_blocks is None:
        return None
    handles = cols.handle[rows].tolist()
    cached = plan.cached_requests
    cached.num_computed_tokens += computed.tolist()
    cached.num_new_blocks += new_blocks[0]
    cached.new_block_ids += new_blocks[1]
    plan.scheduled += handles
    plan.num_scheduled_tokens += n.tolist()
    cols.num_computed[rows] = end
    cols.num_inflight[rows] += 1  # every chunk reaches the end of its tokens: it samples
    record.requests += reqs
    record.handles += handles
    record.rows = rows
    # the blocks whose last known token this plan computes can join the prefix cache
    bs = sched.block_size
    completes = np.minimum(end, lengths) // bs > np.minimum(computed, lengths) // bs
    record.to_cache += [reqs[i] for i in np.flatnonzero(completes).tolist()]
    return budget - total, False


def _grow_block_tables(
    sched: Scheduler, reqs: list[Request], computed: np.ndarray, n: np.ndarray
) -> tuple[list[int], list[int]] | None:
    """How many blocks each request's table grows by (most: none) and those blocks, request
    after request (the plan's flat form); None when the free blocks do not suffice (nothing
    changed: the loop preempts)."""
    bs = sched.block_size
    grows = np.flatnonzero((computed + n + bs - 1) // bs > (computed + bs - 1) // bs).tolist()
    counts, flat = [0] * len(reqs), []
    if grows:
        growing = [reqs[i] for i in grows]
        appended = sched.block_manager.append_slots_all(growing, n[grows].tolist())
        if appended is None:
            return None
        for i, blocks in zip(grows, appended):
            counts[i] = len(blocks)
            flat += blocks
    return counts, flat


def apply_result(sched: Scheduler, record: StepRecord, result: StepResult
                 ) -> list[RequestOutput] | None:  # fmt: skip
    """The outputs of a plain result of `record`'s plan, or None (nothing changed) when it is
    not one for the fast path."""
    cols = sched.columns
    if not _is_plain(result, record) or cols.wants_prompt_logprobs[record.rows].any():
        return None  # (the first output of a request that wants them may carry them)
    reqs, handles, tokens, logprobs, rows = _live(record, result, cols.handle)
    cols.num_inflight[rows] -= 1
    token_lists = list(map(_token_ids, reqs))
    for token_list, token in zip(token_lists, tokens):
        token_list.append(token)
    sched.counters.num_generation_tokens += len(tokens)
    lengths = np.fromiter(map(len, token_lists), np.int64, len(token_lists))
    sampled = np.array(tokens, np.int64)
    offsets = (lengths - cols.num_prompt[rows] - 1).tolist()  # the new tokens' in the output
    outputs = list(map(RequestOutput, handles, sampled.reshape(-1, 1).tolist(), repeat(None),
                       repeat(None), repeat(None), map(_num_cached_tokens, reqs),
                       offsets))  # fmt: skip
    for i, lp in enumerate(logprobs or ()):
        if lp is not None and reqs[i].sampling.logprobs is not None:
            outputs[i].new_logprobs = [lp]
    may_end = _may_end(sampled, lengths, cols.limit[rows], cols.stop_tokens)
    for i in np.flatnonzero(may_end).tolist():
        _check_stop(sched, reqs[i], tokens[i], outputs[i])
    if sched.block_manager.enable_prefix_caching:  # a token that completes a computed block
        completes = (lengths % sched.block_size == 0) & (cols.num_computed[rows] >= lengths)
        for i in np.flatnonzero(completes).tolist():
            if reqs[i].status is RequestStatus.RUNNING:
                sched.block_manager.cache_full_blocks(reqs[i])
    return outputs


def _is_plain(result: StepResult, record: StepRecord) -> bool:
    """One token for each request the plan recorded, in its order, and nothing else but
    logprobs."""
    if result.num_sampled or result.draft_token_ids or result.prompt_logprobs or result.pooled:
        return False
    if result.grammar_done or result.handles != record.handles:
        return False
    num_tokens = len(record.handles)
    logprobs = result.logprobs
    return len(result.sampled_token_ids) == num_tokens and (
        logprobs is None or len(logprobs) == num_tokens
    )


def _live(record: StepRecord, result: StepResult, row_handles: np.ndarray) -> tuple:
    """Of the recorded requests, those not finished since the plan (requests, handles,
    tokens, logprobs, rows): a finished request's row is free or another's now."""
    reqs, handles, rows = record.requests, record.handles, record.rows
    tokens, logprobs = result.sampled_token_ids, result.logprobs
    live = row_handles[rows] == record.row_handles
    if live.all():
        return reqs, handles, tokens, logprobs, rows
    keep = live.tolist()
    reqs, handles = list(compress(reqs, keep)), list(compress(handles, keep))
    tokens = list(compress(tokens, keep))
    logprobs = None if logprobs is None else list(compress(logprobs, keep))
    return reqs, handles, tokens, logprobs, rows[live]


def _may_end(
    sampled: np.ndarray, lengths: np.ndarray, limits: np.ndarray, stop_tokens: np.ndarray
) -> np.ndarray:
    """The requests that this token may end: at their length limit, or a token that stops
    some live request (usually one or two EOS ids: compared one by one, cheaper than isin)."""
    may_end = lengths >= limits
    if len(stop_tokens) > 8:
        return may_end | np.isin(sampled, stop_tokens)
    for token in stop_tokens.tolist():
        may_end |= sampled == token
    return may_end


def _check_stop(sched: Scheduler, req: Request, token: int, output: RequestOutput) -> None:
    reason = req.end_reason(token)
    if reason is not None:
        sched._finish(req, reason)
        output.finish_reason, output.stop_reason = reason, req.stop_reason
