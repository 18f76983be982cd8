"""The scheduler with pipeline parallelism: plans in flight hold disjoint requests, no request
is scheduled while its sampled token is in flight, every plan carries the tokens the stages
have not seen, and the outputs are those of one request alone (the fake worker of
test_scheduler, taking its tokens from the plans as every pipeline stage does)."""

from __future__ import annotations

import random

import pytest

from pagedserve.actors.messages import FinishReason, StepPlan
from pagedserve.actors.scheduler.scheduler import Scheduler
from tests.test_scheduler import (
    LABELS,
    FakeWorker,
    add,
    admit,
    make_config,
    random_workload,
    result,
    run_engine,
    solo,
)


def pipeline_config(**kw: int | bool):
    return make_config(pipeline_parallel_size=2, **kw)


def test_plans_in_flight_split_the_running_requests() -> None:
    sched = Scheduler(pipeline_config(max_num_seqs=6), 64)
    for name in "abcdef":
        admit(sched, add(name, [2, 3, 4], max_tokens=4, ignore_eos=True))
    plans = [sched.schedule() for _ in range(4)]
    # three plans in flight (2 stages + 1), each with a third of the six requests
    assert [len(p.scheduled) for p in plans[:3]] == [2, 2, 2]  # type: ignore[union-attr]
    assert plans[3] is None  # every request has its token in flight
    first = plans[0]
    assert first is not None
    sched.update_from_result(result(sched, first.step_id, {"a": 7, "b": 8}))
    again = sched.schedule()
    assert again is not None and again.scheduled == first.scheduled
    # the plan brings the sampled tokens to every stage
    assert again.cached_requests.num_new_tokens == [1, 1]
    assert again.cached_requests.new_token_ids == [7, 8]
    assert again.num_scheduled_tokens == [1, 1]


def test_prefill_chunks_of_one_request_may_be_in_flight_together() -> None:
    sched = Scheduler(pipeline_config(max_num_batched_tokens=8), 64)
    admit(sched, add("a", list(range(2, 22)), max_tokens=2, ignore_eos=True))
    chunks = [sched.schedule() for _ in range(3)]
    assert [p.num_scheduled_tokens for p in chunks] == [[8], [8], [4]]  # type: ignore[union-attr]
    assert sched.schedule() is None  # the last chunk samples: wait for its token


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pressure", [False, True])
def test_randomized_pipeline_against_solo(seed: int, pressure: bool) -> None:
    rng = random.Random(seed)
    arrivals = random_workload(rng, 20)
    cfg = pipeline_config(
        max_model_len=40,
        max_num_batched_tokens=rng.choice([8, 20, 64]),
        max_num_seqs=rng.choice([3, 8]),
        enable_prefix_caching=rng.random() < 0.85,
    )
    sched = Scheduler(cfg, 10 if pressure else 200)
    worker = FakeWorker(sched.block_manager.num_total_blocks, sched.block_size, True)
    plans: list[StepPlan] = []
    track: dict[str, int] = {}
    out = run_engine(sched, arrivals, depth=3, rng=rng, plans=plans, track=track, worker=worker)
    assert track["max_inflight"] == 1  # never a second token in flight for one request
    for _, req in arrivals:
        got, want = out[LABELS[req.seq]], solo(req, 40)
        assert (got.tokens, got.finish, got.stop_reason) == (
            want.tokens,
            want.finish,
            want.stop_reason,
        ), LABELS[req.seq]
        assert got.finish is not FinishReason.ABORT
    if pressure:
        assert sched.stats().num_preemptions > 0
