"""Pooling requests (embeddings, PoolingParams) in the scheduler.

A pooling request is scheduled as any other, its prompt in chunks within the token budget, and
the chunk that reaches its prompt's end is the one that "samples" (its `num_inflight` counts it,
its plan's record holds it); its limit is one past its prompt, so nothing is scheduled after
that chunk. The worker samples no token for it: the step's result carries its pooled vector
(StepResult.pooled), which finishes it (stop) and goes out with its final output, so its client
gets no token and its usage counts its prompt only. MEAN and CLS pooling need positions that a
prefix-cache hit would skip: such requests take none. A request preempted before its vector
came, or whose workers were lost, computes its prompt again from the start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.actors.messages import FinishReason, RequestOutput
from pagedserve.actors.scheduler.decode_path import StepRecord
from pagedserve.actors.scheduler.request import Request, RequestStatus
from pagedserve.config import EngineConfig

if TYPE_CHECKING:
    from pagedserve.actors.scheduler.scheduler import Scheduler


def takes_cached_prefix(req: Request, config: EngineConfig) -> bool:
    """Whether `req` may start from a prefix-cache hit: no position it needs is skipped (prompt
    logprobs and MEAN / CLS pooling need every one)."""
    if req.prompt_logprobs:
        return False
    return req.pooling is None or not config.pooler_config.pools_every_position


def finish_pooled(
    sched: Scheduler, record: StepRecord, pooled: dict[int, bytes]
) -> list[RequestOutput]:
    """The final outputs of the pooling requests whose vectors a result of `record`'s plan
    brings (a request finished meanwhile, by an abort, has none)."""
    recorded = dict(zip(record.handles, record.requests))
    outputs = []
    for handle, vector in pooled.items():
        req = recorded.get(handle)
        if req is None or req.status is RequestStatus.FINISHED:
            continue
        req.num_inflight -= 1
        req.pooled = vector
        sched._finish(req, FinishReason.STOP)
        outputs.append(req.output([], None))
    return outputs
