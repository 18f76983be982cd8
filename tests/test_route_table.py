"""What the scheduler keeps of finished requests (routes.py): a bounded, compact table.

A finished request is kept for clients that resubmit after a restart, as its final `Route`
encoded in one frame (about 3 bytes a token), never as the `Request` (a Python int object and a
list slot per token, its sampling settings, its lists: ~4 KB at the soak's sizes, 16 MiB for
4,096 of them). Whatever the requests hold, the table's memory stays under 2.5 MiB: at most
4,096 entries and 1 MiB of frames, plus ~300 bytes of keys and dict slots per entry.
"""

from __future__ import annotations

import gc
import os
import random
import tracemalloc
from collections import deque
from collections.abc import Callable

import numpy as np
import pytest

from pagedserve.actors.messages import (
    AddRequest,
    FinishReason,
    SamplingParams,
    StepPlan,
    StepResult,
)
from pagedserve.actors.scheduler.request import Request
from pagedserve.actors.scheduler.routes import FINISHED_BYTES_KEPT, NUM_FINISHED_KEPT, RouteTable
from pagedserve.actors.scheduler.scheduler import Scheduler
from pagedserve.config import EngineConfig

TABLE_BOUND_BYTES = 5 * 2**19  # 2.5 MiB
VOCAB = 4096  # the embedded model's: most token ids are int objects of their own (> 256)


def tokens(rng: random.Random, num: int) -> list[int]:
    """Fresh int objects, as a decoded frame or a sampled token gives the scheduler."""
    return np.random.default_rng(rng.getrandbits(32)).integers(257, VOCAB, num).tolist()


def add_request(rng: random.Random, seq: int, prompt_len: int, max_tokens: int) -> AddRequest:
    return AddRequest(
        client=os.urandom(5),  # a client identity: the ZeroMQ peer's, 5 bytes
        seq=seq,
        prompt_token_ids=tokens(rng, prompt_len),
        sampling=SamplingParams(temperature=0.8, max_tokens=max_tokens),
        eos_token_ids=[0],
    )


def fill(num: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int]) -> RouteTable:
    """A table that has seen `num` requests finish, of these sizes."""
    rng, table = random.Random(0), RouteTable()
    for seq in range(num):
        output_len = rng.randint(*output_lens)
        msg = add_request(rng, seq, rng.randint(*prompt_lens), output_len)
        request = Request.from_add(msg, handle=seq, seed=0)
        request.token_ids += tokens(rng, output_len)
        request.finish_reason = FinishReason.LENGTH
        table.add(request)
        request.release()
        table.finish(request)
    return table


def retained(build: Callable[[], RouteTable]) -> tuple[int, RouteTable]:
    """Bytes of Python objects still allocated once `build` returned its table."""
    fill(1, (1, 1), (1, 1))  # imports and caches of the first call are not the table's
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        table = build()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before, table
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    "num, prompt_lens, output_lens, min_kept",
    [(4_500, (3, 84), (1, 64), 3_000), (600, (1500, 3000), (500, 1000), 1)],
    ids=["soak-sized", "long"],
)
def test_the_finished_requests_kept_stay_under_2_5_mib_whatever_they_hold(
    num: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int], min_kept: int
) -> None:
    size, table = retained(lambda: fill(num, prompt_lens, output_lens))
    kept = len(table.finished)
    assert size < TABLE_BOUND_BYTES, f"{size / 2**20:.2f} MiB for {kept} entries"
    assert min_kept <= kept <= NUM_FINISHED_KEPT  # compact, not only bounded
    assert table.finished_bytes <= FINISHED_BYTES_KEPT
    assert all(isinstance(frame, bytes) for frame in table.finished.values())
    assert table.find(next(reversed(table.finished))) is not None  # the newest


class CountingWorker:
    """Knows each request's length and computed tokens; samples at the end of what it knows."""

    def __init__(self) -> None:
        self.lengths: dict[int, list[int]] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        for handle in plan.finished:
            del self.lengths[handle]
        for new in plan.new_requests:
            self.lengths[new.handle] = [len(new.token_ids), new.num_computed_tokens]
        handles = []
        for handle, n in zip(plan.scheduled, plan.num_scheduled_tokens):
            known = self.lengths[handle]
            known[1] += n
            if known[1] >= known[0]:
                known[0] += 1
                handles.append(handle)
        return StepResult(
            step_id=plan.step_id, handles=handles, sampled_token_ids=[7 + h % 100 for h in handles]
        )


def test_a_scheduler_keeps_no_request_object_once_its_requests_finished() -> None:
    scheduler = Scheduler(EngineConfig(), num_kv_blocks=256)
    worker, rng, pending = CountingWorker(), random.Random(1), deque[StepResult]()
    msgs = [add_request(rng, seq, rng.randint(3, 84), rng.randint(1, 16)) for seq in range(300)]
    for msg in msgs:
        scheduler.add_request(msg)
    while scheduler.requests or pending:
        plan = scheduler.schedule() if len(pending) < 2 else None
        if plan is not None:
            pending.append(worker.execute(plan))
        if pending and (plan is None or len(pending) == 2):
            scheduler.update_from_result(pending.popleft())
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is Request]  # (no __class__ lookups)
    for msg in msgs:  # each is still answered from its frame
        route = scheduler.routes.find((msg.client, msg.seq))
        assert route is not None and route.finish_reason is FinishReason.LENGTH
        assert route.prompt_token_ids == msg.prompt_token_ids
        assert len(route.output_token_ids) == msg.sampling.max_tokens
