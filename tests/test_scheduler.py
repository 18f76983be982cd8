"""Scheduler: token budget, chunked prefill, prefix caching, preemption, async scheduling, stops.

The randomized tests replay every plan on a fake worker that keeps its own token lists and block
tables exactly as the real worker does, writes a fake KV cache (each slot holds a digest of the
prefix up to that position) and "samples" next = f(prefix digest read back through its block
table). Wrong block tables, prefix-cache hits or recompute after preemption change the outputs.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from dataclasses import dataclass, field

import msgspec
import pytest

from pagedserve.actors.detokenizer import OutputStream
from pagedserve.actors.messages import (
    AddRequest,
    FinishReason,
    RequestError,
    RequestOutput,
    Route,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from pagedserve.actors.scheduler.request import Request, RequestStatus
from pagedserve.actors.scheduler.routes import RouteTable
from pagedserve.actors.scheduler.scheduler import Scheduler
from pagedserve.config import EngineConfig

VOCAB = 50
EOS = 1
MASK = (1 << 64) - 1
CLIENT = b"test-client"

# add() gives every request a fresh seq (its route is (CLIENT, seq)); tests name them by label
LABELS: dict[int, str] = {}  # seq -> label
SEQS: dict[str, int] = {}  # label -> its latest seq
_seqs = itertools.count()


def label_of(sched: Scheduler, handle: int) -> str:
    """The label of the request with this handle (live or finished)."""
    for req in sched.requests.values():
        if req.handle == handle:
            return LABELS[req.seq]
    for client, seq in sched.routes.finished:
        route = sched.routes.find((client, seq))
        if route is not None and route.handle == handle:
            return LABELS[seq]
    raise KeyError(handle)


def labels(sched: Scheduler, handles: list[int]) -> list[str]:
    return [label_of(sched, h) for h in handles]


def handle_of(sched: Scheduler, label: str) -> int:
    request = sched.routes.find((CLIENT, SEQS[label]))
    assert request is not None
    return request.handle


def admit(sched: Scheduler, req: AddRequest) -> int:
    """Add a request the scheduler must accept; its handle."""
    route = sched.add_request(req)
    assert isinstance(route, Route), route
    return route.handle


def abort(sched: Scheduler, names: list[str]) -> list[RequestOutput]:
    return sched.abort_requests(CLIENT, [SEQS[n] for n in names if n in SEQS])


def digest(prev: int, token: int) -> int:
    return ((prev ^ (token + 1)) * 1099511628211) & MASK


def fake_model(tokens: list[int]) -> int:
    """The deterministic "model": next token = f(all previous tokens)."""
    d = 14695981039346656037
    for t in tokens:
        d = digest(d, t)
    return d % VOCAB


# ---------------------------------------------------------------- fake worker


@dataclass
class WorkerRequest:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int
    logprobs: bool


class FakeWorker:
    """Applies plans like the real worker: persistent batch, its own sampled tokens, KV cache."""

    def __init__(self, num_blocks: int, block_size: int, tokens_from_plans: bool = False) -> None:
        self.bs = block_size
        self.tokens_from_plans = tokens_from_plans  # pipeline parallelism: see the scheduler
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.reqs: dict[int, WorkerRequest] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.finished:
            del self.reqs[rid]
        for new in plan.new_requests:
            assert new.handle not in self.reqs
            req = WorkerRequest(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens, False
            )
            req.logprobs = new.sampling.logprobs is not None
            self._check_kv(req, new.num_computed_tokens)  # prefix hit: written by earlier steps
            self.reqs[new.handle] = req
        cached = plan.cached_requests  # the plan's first scheduled requests, in flat lists
        blocks, tokens = iter(cached.new_block_ids), iter(cached.new_token_ids)
        for i, num_computed in enumerate(cached.num_computed_tokens):
            req = self.reqs[plan.scheduled[i]]
            assert req.num_computed == num_computed
            req.block_ids.extend(itertools.islice(blocks, cached.num_new_blocks[i]))
            if cached.num_new_tokens:
                req.tokens.extend(itertools.islice(tokens, cached.num_new_tokens[i]))
        assert next(blocks, None) is None and next(tokens, None) is None
        ids, sampled, logprobs = [], [], []
        for rid, n in zip(plan.scheduled, plan.num_scheduled_tokens):
            token = self._run(self.reqs[rid], n)
            if token is not None:
                ids.append(rid)
                sampled.append(token)
                lp = TokenLogprobs(token, -0.5, 1, [], [])
                logprobs.append(lp if self.reqs[rid].logprobs else None)
        return StepResult(
            step_id=plan.step_id, handles=ids, sampled_token_ids=sampled, logprobs=logprobs
        )

    def _run(self, req: WorkerRequest, n: int) -> int | None:
        start, end = req.num_computed, req.num_computed + n
        assert n > 0 and end <= len(req.tokens), "scheduled tokens the worker does not know"
        assert len(req.block_ids) * self.bs >= end, "block table too short"
        digests = self._digests(req.tokens[:end])
        for pos in range(start, end):
            self.kv[req.block_ids[pos // self.bs]][pos % self.bs] = digests[pos]
        req.num_computed = end
        if end < len(req.tokens):
            return None
        self._check_kv(req, end)
        token = self.kv[req.block_ids[(end - 1) // self.bs]][(end - 1) % self.bs] % VOCAB
        if not self.tokens_from_plans:
            req.tokens.append(token)
        return token

    def _check_kv(self, req: WorkerRequest, end: int) -> None:
        digests = self._digests(req.tokens[:end])
        for pos in range(end):
            slot = self.kv[req.block_ids[pos // self.bs]][pos % self.bs]
            assert slot == digests[pos], f"KV at position {pos} is not this request's prefix"

    @staticmethod
    def _digests(tokens: list[int]) -> list[int]:
        d, out = 14695981039346656037, []
        for t in tokens:
            d = digest(d, t)
            out.append(d)
        return out


# ---------------------------------------------------------------- driver


@dataclass
class Collected:
    tokens: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0


def collect(sched: Scheduler, into: dict[str, Collected], outputs: list[RequestOutput]) -> None:
    for out in outputs:
        name = label_of(sched, out.handle)
        c = into.setdefault(name, Collected())
        assert c.finish is None, f"output for {name} after it finished"
        c.tokens.extend(out.new_token_ids)
        c.finish, c.stop_reason = out.finish_reason, out.stop_reason
        c.num_cached_tokens = out.num_cached_tokens


def check_views(sched: Scheduler, worker: FakeWorker, plan: StepPlan) -> None:
    """The worker's persistent batch agrees with the scheduler, right after a plan ran."""
    cfg = sched.config
    assert sum(plan.num_scheduled_tokens) <= cfg.max_num_batched_tokens
    assert len(plan.scheduled) == len(set(plan.scheduled)) <= cfg.max_num_seqs
    in_worker = {rid for rid, r in sched.requests.items() if r.in_worker}
    assert set(worker.reqs) == in_worker
    for rid in in_worker:
        s, w = sched.requests[rid], worker.reqs[rid]
        assert s.status is RequestStatus.RUNNING
        assert w.block_ids == s.block_table
        assert w.num_computed == s.num_computed_tokens
        if sched.pipelined:  # the workers know the tokens the plans brought them
            assert w.tokens == s.token_ids[: s.num_sent_tokens]
        else:
            assert w.tokens[: s.num_tokens] == s.token_ids
            assert len(w.tokens) == s.num_tokens_with_inflight


def run_engine(
    sched: Scheduler,
    arrivals: list[tuple[int, AddRequest]],
    depth: int,
    rng: random.Random | None = None,
    aborts: dict[int, list[str]] | None = None,
    plans: list[StepPlan] | None = None,
    track: dict[str, int] | None = None,
    worker: FakeWorker | None = None,
) -> dict[str, Collected]:
    """Drive the scheduler like the actor does, with up to `depth` plans in flight."""
    worker = worker or FakeWorker(sched.block_manager.num_total_blocks, sched.block_size)
    arrivals = sorted(arrivals, key=lambda a: a[0])
    results: dict[str, Collected] = {}
    pending: deque[StepResult] = deque()
    tick = 0
    while arrivals or sched.requests:
        while arrivals and arrivals[0][0] <= tick:
            admit(sched, arrivals.pop(0)[1])
        collect(sched, results, abort(sched, (aborts or {}).get(tick, [])))
        plan = sched.schedule() if len(pending) < depth else None
        if plan is not None:
            pending.append(worker.execute(plan))
            check_views(sched, worker, plan)
            if track is not None:
                most = max((r.num_inflight for r in sched.requests.values()), default=0)
                track["max_inflight"] = max(track.get("max_inflight", 0), most)
            if plans is not None:
                plans.append(plan)
        if pending and (plan is None or (rng is not None and rng.random() < 0.3)):
            collect(sched, results, sched.update_from_result(pending.popleft()))
        elif plan is None:
            assert arrivals or not sched.requests, "deadlock: nothing to run or wait for"
        tick += 1
        assert tick < 100_000
    for result in pending:  # results of requests finished meanwhile are ignored
        assert sched.update_from_result(result) == []
    assert_no_leak(sched)
    return results


def assert_no_leak(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not sched.running and not sched.waiting and not sched.requests


def make_config(**kw: int | bool) -> EngineConfig:
    base: dict = dict(block_size=4, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32)
    base["max_waiting_requests"] = 1000
    base.update(kw)
    return EngineConfig(**base)


def add(rid: str, prompt: list[int], **sampling: object) -> AddRequest:
    """A request labelled `rid`, with a fresh seq."""
    sampling.setdefault("max_tokens", 8)
    seq = next(_seqs)
    LABELS[seq], SEQS[rid] = rid, seq
    return AddRequest(
        client=CLIENT,
        seq=seq,
        prompt_token_ids=prompt,
        sampling=SamplingParams(**sampling),  # type: ignore[arg-type]
        eos_token_ids=[EOS],
    )


def solo(req: AddRequest, max_model_len: int = 64) -> Collected:
    """Run one request alone, one plan at a time, with plenty of room."""
    sched = Scheduler(make_config(max_model_len=max_model_len, max_num_batched_tokens=256), 64)
    return run_engine(sched, [(0, req)], depth=1)[LABELS[req.seq]]


def result(sched: Scheduler, step_id: int, tokens: dict[str, int]) -> StepResult:
    """The result of step `step_id` sampling these tokens (by label)."""
    handles = [handle_of(sched, name) for name in tokens]
    return StepResult(step_id=step_id, handles=handles, sampled_token_ids=list(tokens.values()))


def step(sched: Scheduler, tokens: dict[str, int]) -> tuple[StepPlan, list[RequestOutput]]:
    """Schedule one plan and feed back chosen tokens for the requests it samples."""
    plan = sched.schedule()
    assert plan is not None
    scheduled = labels(sched, plan.scheduled)
    chosen = {name: t for name, t in tokens.items() if name in scheduled}
    return plan, sched.update_from_result(result(sched, plan.step_id, chosen))


# ---------------------------------------------------------------- budget and chunking


def test_chunked_prefill_splits_a_long_prompt_within_the_budget() -> None:
    sched = Scheduler(make_config(max_num_batched_tokens=16), 32)
    prompt = [(7 * i) % VOCAB + 2 for i in range(50)]
    plans: list[StepPlan] = []
    out = run_engine(sched, [(0, add("a", prompt, max_tokens=3))], depth=1, plans=plans)
    assert [p.num_scheduled_tokens for p in plans[:4]] == [[16], [16], [16], [2]]
    assert plans[0].new_requests[0].token_ids == prompt
    assert plans[0].new_requests[0].num_computed_tokens == 0
    assert [p.cached_requests.num_computed_tokens for p in plans[1:4]] == [[16], [32], [48]]
    assert plans[0].new_requests[0].block_ids == [0, 1, 2, 3]
    assert plans[1].cached_requests.new_block_ids == [4, 5, 6, 7]
    assert plans[3].cached_requests.new_block_ids == [12]
    assert out["a"].tokens == solo(add("a", prompt, max_tokens=3)).tokens
    assert sched.stats().num_prompt_tokens == 50 and sched.stats().num_generation_tokens == 3


def test_budget_and_max_num_seqs_are_respected() -> None:
    sched = Scheduler(make_config(max_num_batched_tokens=10, max_num_seqs=2), 64)
    plans: list[StepPlan] = []
    reqs = [(0, add(f"r{i}", [i + 2] * (5 + 3 * i), max_tokens=4)) for i in range(5)]
    run_engine(sched, reqs, depth=2, plans=plans)
    assert max(sum(p.num_scheduled_tokens) for p in plans) == 10
    assert max(len(p.scheduled) for p in plans) == 2
    # FCFS: r0 and r1 are admitted first, the rest only once seats free up.
    assert labels(sched, plans[0].scheduled) == ["r0", "r1"]
    assert plans[0].num_scheduled_tokens == [5, 5]  # r1's 8-token prompt is chunked


def test_waiting_request_is_admitted_into_leftover_budget() -> None:
    sched = Scheduler(make_config(max_num_batched_tokens=12), 64)
    admit(sched, add("a", [5] * 10))
    admit(sched, add("b", [6] * 10))
    plan = sched.schedule()
    assert plan is not None
    assert labels(sched, plan.scheduled) == ["a", "b"] and plan.num_scheduled_tokens == [10, 2]


# ---------------------------------------------------------------- prefix caching


def test_prefix_cache_hit_for_a_shared_prefix() -> None:
    shared = [(3 * i) % VOCAB + 2 for i in range(16)]
    sched = Scheduler(make_config(), 32)
    admit(sched, add("a", shared + [9, 9, 9], max_tokens=2))
    plan_a = sched.schedule()
    assert plan_a is not None and plan_a.new_requests[0].num_computed_tokens == 0
    admit(sched, add("b", shared + [8, 8], max_tokens=2))
    plan_b = sched.schedule()
    assert plan_b is not None
    new_b = plan_b.new_requests[0]
    assert label_of(sched, new_b.handle) == "b" and new_b.num_computed_tokens == 16
    assert plan_b.num_scheduled_tokens[plan_b.scheduled.index(new_b.handle)] == 2
    a, b = sched.requests[handle_of(sched, "a")], sched.requests[new_b.handle]
    assert b.block_table[:4] == a.block_table[:4]
    assert all(sched.block_manager.blocks[x].ref_count == 2 for x in a.block_table[:4])
    stats = sched.stats()
    assert stats.prefix_cache_queries == 19 + 18 and stats.prefix_cache_hits == 16


def test_prefix_hit_after_the_first_request_finished() -> None:
    shared = [(5 * i) % VOCAB + 2 for i in range(12)]
    sched, worker = Scheduler(make_config(), 32), FakeWorker(32, 4)
    first = run_engine(sched, [(0, add("a", shared + [4], max_tokens=3))], 2, worker=worker)
    assert first["a"].num_cached_tokens == 0
    plans: list[StepPlan] = []
    req = add("b", shared + [7, 7], max_tokens=5)
    out = run_engine(sched, [(0, req)], depth=2, plans=plans, worker=worker)
    assert plans[0].new_requests[0].num_computed_tokens == 12
    assert out["b"].num_cached_tokens == 12
    assert sched.stats().prefix_cache_hits == 12
    assert out["b"].tokens == solo(req).tokens


def test_prefix_caching_can_be_disabled() -> None:
    shared = [2] * 12
    sched, worker = Scheduler(make_config(enable_prefix_caching=False), 32), FakeWorker(32, 4)
    run_engine(sched, [(0, add("a", shared + [4], max_tokens=2))], 1, worker=worker)
    plans: list[StepPlan] = []
    run_engine(sched, [(0, add("b", shared + [5], max_tokens=2))], 1, plans=plans, worker=worker)
    assert plans[0].new_requests[0].num_computed_tokens == 0
    assert sched.stats().prefix_cache_queries == 0


# ---------------------------------------------------------------- leaks, aborts, validation


def test_no_block_leaked_after_finish_and_abort() -> None:
    sched = Scheduler(make_config(), 32)
    arrivals = [
        (0, add(f"r{i}", [i + 2] * (6 + i), max_tokens=10, ignore_eos=True)) for i in range(4)
    ]
    out = run_engine(sched, arrivals, depth=2, aborts={2: ["r1"], 3: ["r3", "nope"]})
    assert out["r1"].finish is FinishReason.ABORT and out["r3"].finish is FinishReason.ABORT
    assert out["r0"].finish is FinishReason.LENGTH and len(out["r0"].tokens) == 10


def test_abort_output_and_finished_ids_sent_once() -> None:
    sched = Scheduler(make_config(), 32)
    admit(sched, add("a", [3] * 5))
    admit(sched, add("b", [4] * 5))
    plan = sched.schedule()
    assert plan is not None
    outs = abort(sched, ["a", "a", "zzz"])
    assert len(outs) == 1 and outs[0].finish_reason is FinishReason.ABORT
    assert outs[0].new_token_ids == []
    # The in-flight result for "a" is ignored; "b" advances.
    outs = sched.update_from_result(result(sched, plan.step_id, {"a": 5, "b": 6}))
    assert labels(sched, [o.handle for o in outs]) == ["b"]
    nxt = sched.schedule()
    assert nxt is not None and labels(sched, nxt.finished) == ["a"]
    assert labels(sched, nxt.scheduled) == ["b"]
    later = sched.schedule()
    assert later is not None and later.finished == []
    assert abort(sched, ["a"]) == []


def test_requests_that_can_never_run_are_refused() -> None:
    sched = Scheduler(make_config(max_model_len=16), 32)
    empty = sched.add_request(add("empty", []))
    assert isinstance(empty, RequestError) and empty.status_code == 400
    long = sched.add_request(add("long", [2] * 16))
    assert isinstance(long, RequestError) and "maximum context length is 16" in long.message
    assert long.client == CLIENT and long.seq == SEQS["long"]
    admit(sched, add("ok", [2] * 15))
    out = run_engine(sched, [], depth=1)
    assert out["ok"].tokens and out["ok"].finish is FinishReason.LENGTH
    assert len(out["ok"].tokens) == 1  # 15 + 1 = max_model_len


def test_a_prompt_larger_than_the_kv_cache_is_refused() -> None:
    sched = Scheduler(make_config(max_model_len=64), 4)  # 4 blocks of 4: 16 tokens
    refused = sched.add_request(add("big", [2] * 20))
    assert isinstance(refused, RequestError) and refused.status_code == 400
    assert "KV cache holds at most 16 tokens" in refused.message


def test_admission_control_refuses_beyond_the_waiting_limit() -> None:
    sched = Scheduler(make_config(max_waiting_requests=2), 32)
    admit(sched, add("a", [2] * 3))
    admit(sched, add("b", [2] * 3))
    refused = sched.add_request(add("c", [2] * 3))
    assert isinstance(refused, RequestError) and refused.status_code == 503
    sched.schedule()  # a and b run: room again
    admit(sched, add("d", [2] * 3))
    for limit in (0, -5):  # an operator's impossible limit fails at start, clearly
        with pytest.raises(ValueError, match="max_waiting_requests must be at least 1"):
            make_config(max_waiting_requests=limit)


# ---------------------------------------------------------------- preemption


def test_preempts_newest_running_request_and_resumes_it() -> None:
    # 6 blocks of 4: two 8-token prompts take 4 blocks; decoding exhausts the rest.
    sched = Scheduler(make_config(max_model_len=24), 6)
    reqs = [
        add("old", [2 + i for i in range(8)], max_tokens=10, ignore_eos=True),
        add("new", [30 + i for i in range(8)], max_tokens=10, ignore_eos=True),
    ]
    plans: list[StepPlan] = []
    out = run_engine(sched, [(0, r) for r in reqs], depth=1, plans=plans)
    assert sched.stats().num_preemptions >= 1
    first = next(i for i, p in enumerate(plans) if p.finished)
    assert labels(sched, plans[first].finished) == ["new"]
    scheduled = labels(sched, plans[first].scheduled)
    assert "new" not in scheduled and "old" in scheduled
    new = handle_of(sched, "new")
    admitted = next(n for n in plans[0].new_requests if n.handle == new)
    resumed = next(n for p in plans[first:] for n in p.new_requests if n.handle == new)
    assert resumed.token_ids[:8] == reqs[1].prompt_token_ids and len(resumed.token_ids) > 8
    # what the worker needs to continue exactly where it stopped: the prompt's end, the RNG key
    assert resumed.num_prompt_tokens == 8 and resumed.seed == admitted.seed
    for r in reqs:
        assert out[LABELS[r.seq]].tokens == solo(r, 24).tokens
        assert len(out[LABELS[r.seq]].tokens) == 10


def prioritized(rid: str, prompt: list[int], priority: int, **sampling: object) -> AddRequest:
    return msgspec.structs.replace(add(rid, prompt, **sampling), priority=priority)


def test_priority_policy_admits_by_priority_and_preempts_the_lowest() -> None:
    """scheduling_policy "priority" (vLLM's): waiting requests are admitted by (priority,
    arrival), lower first; under KV pressure the lowest-priority running request is
    preempted, not the newest, and waits again in priority order. FCFS refuses a priority."""
    sched = Scheduler(
        make_config(max_model_len=24, max_num_seqs=2, scheduling_policy="priority"), 5
    )
    admit(sched, prioritized("low", [2] * 8, 5, max_tokens=10, ignore_eos=True))
    admit(sched, prioritized("high", [3] * 8, 0, max_tokens=10, ignore_eos=True))
    admit(sched, prioritized("mid", [4] * 3, 1, max_tokens=10, ignore_eos=True))
    admit(sched, prioritized("high2", [5] * 3, 0, max_tokens=10, ignore_eos=True))
    assert [LABELS[r.seq] for r in sched.waiting] == ["high", "high2", "mid", "low"]
    p0, _ = step(sched, {"high": 7, "high2": 7})  # two seats: the two of priority 0
    assert labels(sched, p0.scheduled) == ["high", "high2"]
    p1, _ = step(sched, {"high": 7, "high2": 7})
    assert labels(sched, p1.scheduled) == ["high", "high2"]
    abort(sched, ["high2"])
    p2, _ = step(sched, {"high": 7, "mid": 7})  # the freed seat goes to "mid", not "low"
    assert labels(sched, p2.scheduled) == ["high", "mid"]
    # "old-low" runs first; "new-high" joins: 5 of 5 blocks held. The next decodes need one
    # more block: the lower priority yields although it is the older (FCFS: the newer)
    policy = make_config(max_model_len=24, max_num_seqs=2, scheduling_policy="priority")
    tight = Scheduler(policy, 5)
    admit(tight, prioritized("old-low", [2] * 8, 3, max_tokens=10, ignore_eos=True))
    step(tight, {"old-low": 7})
    admit(tight, prioritized("new-high", [3] * 8, 1, max_tokens=10, ignore_eos=True))
    joined, _ = step(tight, {"old-low": 7, "new-high": 7})
    assert labels(tight, joined.scheduled) == ["old-low", "new-high"]
    assert tight.block_manager.num_free_blocks == 0
    pressed, _ = step(tight, {"new-high": 7})
    assert labels(tight, pressed.finished) == ["old-low"]  # dropped from the worker: preempted
    assert labels(tight, pressed.scheduled) == ["new-high"]
    assert [LABELS[r.seq] for r in tight.waiting] == ["old-low"]
    fcfs = Scheduler(make_config(), 16)
    refused = fcfs.add_request(prioritized("p", [2, 3], 1))
    assert isinstance(refused, RequestError) and "priority" in refused.message
    assert refused.status_code == 400


def test_preempted_request_keeps_inflight_token_and_waits_for_it() -> None:
    sched = Scheduler(make_config(max_model_len=24, max_num_seqs=2), 5)
    admit(sched, add("old", [2] * 8, max_tokens=10, ignore_eos=True))
    admit(sched, add("new", [3] * 8, max_tokens=10, ignore_eos=True))
    admit(sched, add("late", [4] * 3, max_tokens=10, ignore_eos=True))  # no seat yet
    p0 = sched.schedule()  # both prefills (4 blocks), both sample
    assert p0 is not None and labels(sched, p0.scheduled) == ["old", "new"]
    p1 = sched.schedule()  # decodes need 2 new blocks, 1 free: "new" is preempted
    assert p1 is not None and labels(sched, p1.finished) == ["new"]
    assert labels(sched, p1.scheduled) == ["old"]  # a step that preempts admits nobody
    assert [LABELS[r.seq] for r in sched.waiting] == ["new", "late"]  # back at the front
    new = sched.requests[handle_of(sched, "new")]
    assert new.status is RequestStatus.WAITING and new.block_table == []
    assert new.num_inflight == 1
    assert sched.stats().num_preemptions == 1
    assert abort(sched, ["old"])[0].finish_reason is FinishReason.ABORT
    p2 = sched.schedule()  # "new" must not resume while its token is in flight
    assert p2 is not None and labels(sched, p2.scheduled) == ["late"]
    assert labels(sched, p2.finished) == ["old"]
    outs = sched.update_from_result(result(sched, p0.step_id, {"old": 7, "new": 8}))
    assert [(o.handle, o.new_token_ids) for o in outs] == [(new.handle, [8])]  # token kept
    assert new.token_ids == [3] * 8 + [8] and not new.num_inflight
    p3 = sched.schedule()
    assert p3 is not None and labels(sched, p3.scheduled) == ["late", "new"]
    assert p3.new_requests[0].token_ids == [3] * 8 + [8]
    # Its first block is still cached; its second was the oldest free block, taken by "late".
    assert p3.new_requests[0].num_computed_tokens == 4


# ---------------------------------------------------------------- async scheduling


def test_async_two_plans_in_flight_match_one_at_a_time() -> None:
    reqs = [
        add(f"r{i}", [(i * 11 + j) % VOCAB + 2 for j in range(3 + 5 * i)], max_tokens=12)
        for i in range(5)
    ]
    outputs = {}
    for depth in (1, 2):
        sched = Scheduler(make_config(max_num_batched_tokens=16), 40)
        track: dict[str, int] = {}
        outputs[depth] = run_engine(sched, [(0, r) for r in reqs], depth=depth, track=track)
        # depth 2: some request had two sampled tokens in flight at once
        assert track["max_inflight"] == depth
    assert outputs[1] == outputs[2]
    for r in reqs:
        assert outputs[2][LABELS[r.seq]].tokens == solo(r).tokens


def test_async_plan_before_result_schedules_one_decode() -> None:
    sched = Scheduler(make_config(), 32)
    admit(sched, add("a", [2, 3, 4, 5, 6], max_tokens=3, ignore_eos=True))
    p0, p1 = sched.schedule(), sched.schedule()  # no result in between
    assert p0 is not None and p1 is not None
    assert p0.num_scheduled_tokens == [5] and p1.num_scheduled_tokens == [1]
    assert p1.cached_requests.num_computed_tokens == [5]
    assert sched.requests[handle_of(sched, "a")].num_inflight == 2
    o0 = sched.update_from_result(result(sched, p0.step_id, {"a": 9}))
    p2 = sched.schedule()  # third and last token
    assert p2 is not None and p2.num_scheduled_tokens == [1]
    assert sched.schedule() is None  # a fourth sample would pass max_tokens
    o1 = sched.update_from_result(result(sched, p1.step_id, {"a": 8}))
    o2 = sched.update_from_result(result(sched, p2.step_id, {"a": 7}))
    assert [o.new_token_ids for o in o0 + o1 + o2] == [[9], [8], [7]]
    assert o2[0].finish_reason is FinishReason.LENGTH
    assert_no_leak(sched)


def test_async_no_decode_past_max_tokens_or_max_model_len() -> None:
    sched = Scheduler(make_config(max_model_len=8), 32)
    admit(sched, add("a", [2] * 5, max_tokens=1))
    admit(sched, add("b", [2] * 6, max_tokens=None))  # may reach 8 tokens: 2 outputs
    p0, p1 = sched.schedule(), sched.schedule()
    assert p0 is not None and p1 is not None
    assert labels(sched, p1.scheduled) == ["b"]
    assert sched.schedule() is None


def test_results_after_finish_are_ignored_and_handles_are_never_reused() -> None:
    sched = Scheduler(make_config(), 32)
    admit(sched, add("a", [2] * 5))
    p0, p1 = sched.schedule(), sched.schedule()
    assert p0 is not None and p1 is not None
    first = handle_of(sched, "a")
    outs = sched.update_from_result(result(sched, p0.step_id, {"a": EOS}))
    assert outs[0].finish_reason is FinishReason.STOP
    second = admit(sched, add("a", [3] * 5))  # the label is reused while step 1 is in flight
    assert second != first
    p2 = sched.schedule()
    assert p2 is not None and p2.finished == [first] and p2.new_requests[0].token_ids == [3] * 5
    stale = StepResult(step_id=p1.step_id, handles=[first], sampled_token_ids=[5])
    assert sched.update_from_result(stale) == []
    fresh = StepResult(step_id=p2.step_id, handles=[second], sampled_token_ids=[6])
    assert [o.new_token_ids for o in sched.update_from_result(fresh)] == [[6]]
    abort(sched, ["a"])
    assert_no_leak(sched)


def test_two_clients_with_the_same_seq_are_two_requests() -> None:
    sched = Scheduler(make_config(), 32)
    request = add("x", [2] * 5)
    other = msgspec.structs.replace(request, client=b"another-client", prompt_token_ids=[4] * 5)
    first, second = admit(sched, request), admit(sched, other)
    assert first != second and len(sched.requests) == 2
    assert sched.abort_requests(b"another-client", [request.seq])[0].handle == second
    assert list(sched.requests) == [first]


def test_a_resubmitted_route_gets_its_request_back_not_a_copy() -> None:
    sched = Scheduler(make_config(), 32)
    request = add("a", [2] * 5, max_tokens=3, ignore_eos=True)
    handle = admit(sched, request)
    step(sched, {"a": 7})
    again = sched.add_request(msgspec.structs.replace(request, resume_token_ids=[7]))
    assert isinstance(again, Route) and again.handle == handle
    assert again.output_token_ids == [7] and again.finish_reason is None
    assert len(sched.requests) == 1
    step(sched, {"a": 8})
    step(sched, {"a": 9})
    done = sched.add_request(request)  # finished meanwhile: its result again
    assert isinstance(done, Route) and done.handle == handle
    assert done.output_token_ids == [7, 8, 9] and done.finish_reason is FinishReason.LENGTH
    assert_no_leak(sched)


def test_a_route_built_after_a_result_and_that_results_output_stream_each_token_once() -> None:
    """A resubmission handled in the same batch as a step's result (after it) gets a route that
    already holds the step's token; the detokenizer, new after a restart, opens its stream
    from that route and then reads the step's output: the output's offset says the token was
    sent (a fresh-clone CI run once streamed it twice after a kill -9 of the detokenizer)."""
    sched = Scheduler(make_config(), 32)
    request = add("a", [2] * 5, max_tokens=4, ignore_eos=True)
    admit(sched, request)
    offsets = []
    for token in (7, 8, 9):  # a prefill step, then decode steps (the columnar fast path)
        (output,) = step(sched, {"a": token})[1]
        offsets.append(output.output_offset)
    assert offsets == [0, 1, 2]
    route = sched.add_request(msgspec.structs.replace(request, resume_token_ids=[7]))
    assert isinstance(route, Route) and route.output_token_ids == [7, 8, 9]
    stream = OutputStream(CLIENT, request.seq, route.prompt_token_ids, None)
    replay = stream.push(route.output_token_ids, None, None, None, 0)
    assert stream.unsent(output) == ([], None)  # the route carried the last step's token
    (last,) = step(sched, {"a": 10})[1]
    assert stream.unsent(last) == ([10], None)
    final = stream.push([10], None, last.finish_reason, None, 0)
    assert replay.token_ids + final.token_ids == [7, 8, 9, 10]
    assert final.token_offset == 3 and final.finish_reason is FinishReason.LENGTH
    assert_no_leak(sched)


def test_finished_routes_are_kept_encoded_newest_first_within_both_bounds() -> None:
    """The route table keeps a finished request's final route as one encoded frame (not the
    request), and forgets the oldest beyond its count or its bytes."""
    routes = RouteTable(num_finished_kept=3, bytes_kept=10_000)
    requests = []
    for i in range(5):
        req = Request.from_add(add(f"f{i}", [2 + i] * 4, max_tokens=2), handle=i, seed=0)
        req.token_ids += [7, 8]
        req.finish_reason, req.stop_reason = FinishReason.STOP, 8
        routes.add(req)
        routes.finish(req)
        requests.append(req)
    assert all(isinstance(frame, bytes) for frame in routes.finished.values())
    assert [routes.find(r.route_key) for r in requests[:2]] == [None, None]
    assert [routes.find(r.route_key) for r in requests[2:]] == [r.route() for r in requests[2:]]
    assert routes.finished_bytes == sum(map(len, routes.finished.values()))
    long = Request.from_add(add("long", [3000] * 4000, max_tokens=2), handle=9, seed=0)
    routes.add(long)
    routes.finish(long)  # alone beyond the bytes: only the newest one is kept
    assert list(routes.finished) == [long.route_key] and routes.find(long.route_key) is not None


def test_a_resumed_request_continues_after_the_tokens_its_client_holds() -> None:
    request = add("r", [5, 9, 13, 4], max_tokens=6, ignore_eos=True)
    want = solo(request).tokens
    resumed = add("r2", [5, 9, 13, 4], max_tokens=6, ignore_eos=True)
    resumed.resume_token_ids = want[:2]
    sched = Scheduler(make_config(), 32)
    plans: list[StepPlan] = []
    out = run_engine(sched, [(0, resumed)], depth=2, plans=plans)
    assert out["r2"].tokens == want[2:]  # four more tokens: max_tokens counts the resumed ones
    assert plans[0].new_requests[0].num_prompt_tokens == 4
    held = add("r3", [5, 9, 13, 4], max_tokens=6, ignore_eos=True)
    held.resume_token_ids = want  # its client holds everything: it ends at once
    route = sched.add_request(held)
    assert isinstance(route, Route) and route.finish_reason is FinishReason.LENGTH
    assert_no_leak(sched)


# ---------------------------------------------------------------- stop conditions


def run_tokens(sched: Scheduler, rid: str, tokens: list[int]) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    for t in tokens:
        outs += step(sched, {rid: t})[1]
        if outs[-1].finish_reason is not None:
            break
    return outs


def test_stop_conditions() -> None:
    def finish(tokens: list[int], **kw: object) -> tuple[int, FinishReason | None, int | None]:
        sched = Scheduler(make_config(max_model_len=12), 32)
        admit(sched, add("a", [2, 3, 4], **kw))
        outs = run_tokens(sched, "a", tokens)
        last = outs[-1]
        return len(outs), last.finish_reason, last.stop_reason

    assert finish([5, EOS, 6]) == (2, FinishReason.STOP, None)
    assert finish([5, EOS, 6], ignore_eos=True, max_tokens=3) == (3, FinishReason.LENGTH, None)
    assert finish([5, 7, 6], stop_token_ids=[7]) == (2, FinishReason.STOP, 7)
    assert finish([EOS, 7, EOS], min_tokens=3) == (3, FinishReason.STOP, None)
    assert finish([7, 7, 5], min_tokens=2, stop_token_ids=[7]) == (2, FinishReason.STOP, 7)
    assert finish([5, 6], max_tokens=2) == (2, FinishReason.LENGTH, None)
    assert finish([5, EOS], max_tokens=2) == (2, FinishReason.STOP, None)  # EOS before LENGTH
    assert finish([5] * 9, max_tokens=None) == (9, FinishReason.LENGTH, None)  # 3 + 9 = 12


def test_outputs_carry_logprobs_and_cached_tokens() -> None:
    sched = Scheduler(make_config(), 32)
    admit(sched, add("lp", [2] * 5, logprobs=2))
    admit(sched, add("no", [3] * 5))
    plan = sched.schedule()
    assert plan is not None
    lp = TokenLogprobs(6, -0.1, 1, [6, 7], [-0.1, -2.0])
    outs = sched.update_from_result(
        StepResult(
            step_id=0,
            handles=[handle_of(sched, "lp"), handle_of(sched, "no")],
            sampled_token_ids=[6, 6],
            logprobs=[lp, lp],
        )
    )
    assert outs[0].new_logprobs == [lp] and outs[1].new_logprobs is None
    assert outs[0].num_cached_tokens == 0 and outs[0].finish_reason is None


def test_stats() -> None:
    sched = Scheduler(make_config(), 20)
    admit(sched, add("a", [2] * 9))
    admit(sched, add("b", [3] * 3))
    sched.schedule()
    s = sched.stats()
    assert (s.num_running, s.num_waiting, s.num_total_blocks) == (2, 0, 20)
    assert s.num_free_blocks == 20 - 3 - 1 and s.num_steps == 1 and s.num_prompt_tokens == 12


# ---------------------------------------------------------------- randomized against solo runs


def random_workload(rng: random.Random, n: int) -> list[tuple[int, AddRequest]]:
    prefixes = [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    arrivals = []
    for i in range(n):
        prompt = rng.choice(prefixes) if rng.random() < 0.6 else []
        prompt = prompt + [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 12))]
        max_tokens = rng.choice([None, 1, 2, 5, 9, 16, 25])
        sampling = dict(
            max_tokens=max_tokens,
            min_tokens=min(rng.choice([0, 0, 2]), max_tokens or 2),
            ignore_eos=rng.random() < 0.2,
            stop_token_ids=rng.sample(range(2, VOCAB), 2) if rng.random() < 0.3 else None,
            logprobs=0 if rng.random() < 0.2 else None,
        )
        arrivals.append((rng.randrange(0, 30), add(f"q{i}", prompt, **sampling)))
    return arrivals


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("pressure", [False, True])
def test_randomized_against_solo(seed: int, depth: int, pressure: bool) -> None:
    rng = random.Random(seed * 10 + depth)
    arrivals = random_workload(rng, 20)
    num_blocks = 10 if pressure else 200  # 10 blocks * 4 = 40 = max_model_len
    cfg = make_config(
        max_model_len=40,
        max_num_batched_tokens=rng.choice([8, 20, 64]),
        max_num_seqs=rng.choice([3, 8]),
        enable_prefix_caching=rng.random() < 0.85,
    )
    aborts = {rng.randrange(5, 60): [f"q{rng.randrange(20)}"] for _ in range(3)}
    sched = Scheduler(cfg, num_blocks)
    out = run_engine(sched, arrivals, depth=depth, rng=rng, aborts=aborts)
    for _, req in arrivals:
        got, want = out[LABELS[req.seq]], solo(req, 40)
        if got.finish is FinishReason.ABORT:
            assert want.tokens[: len(got.tokens)] == got.tokens
        else:
            assert (got.tokens, got.finish, got.stop_reason) == (
                want.tokens,
                want.finish,
                want.stop_reason,
            ), LABELS[req.seq]
    stats = sched.stats()
    assert stats.num_generation_tokens == sum(len(c.tokens) for c in out.values())
    if pressure:
        assert stats.num_preemptions > 0


def test_fake_model_matches_worker_sampling() -> None:
    """The fake worker's KV digests implement next = fake_model(prefix)."""
    req = add("a", [2, 9, 4, 13], max_tokens=5, ignore_eos=True)
    tokens = list(req.prompt_token_ids)
    for _ in range(5):
        tokens.append(fake_model(tokens))
    assert solo(req).tokens == tokens[4:]


def test_a_request_with_drafts_in_flight_waits_when_speculation_switches_off() -> None:
    """disable_by_batch_size: two more requests arrive while a's drafts are verified (3 > 2);
    the next plan, made before a's result, does not speculate, and must not schedule a: how
    many of its drafts the step in flight accepts is not known yet."""
    from pagedserve.config import SpeculativeConfig

    spec = SpeculativeConfig(num_speculative_tokens=3, method="ngram", disable_by_batch_size=2)
    sched = Scheduler(make_config(max_num_batched_tokens=64, speculative_config=spec), 64)
    sched.add_request(add("a", [3, 4, 5, 6], max_tokens=20))
    prefill = sched.schedule()
    assert prefill is not None and prefill.propose
    proposals = [7, 8, 9]
    sched.update_from_result(
        StepResult(
            step_id=prefill.step_id,
            handles=[handle_of(sched, "a")],
            sampled_token_ids=[6],
            draft_token_ids=[proposals],
        )  # fmt: skip
    )
    verify = sched.schedule()
    assert verify is not None and verify.spec_token_ids[0] == proposals
    sched.add_request(add("b", [5, 6, 7]))
    sched.add_request(add("c", [6, 7, 8]))
    after = sched.schedule()
    assert len(sched.running) == 3
    assert after is not None and not after.propose
    assert handle_of(sched, "a") not in after.scheduled
    assert all(n > 0 for n in after.num_scheduled_tokens)
    sched.update_from_result(
        StepResult(
            step_id=verify.step_id,
            handles=verify.scheduled[:1],
            sampled_token_ids=[7, 8, 2],
            num_sampled=[3],
        )  # fmt: skip
    )
    resumed = sched.schedule()
    assert resumed is not None and handle_of(sched, "a") in resumed.scheduled
    assert all(n > 0 for n in resumed.num_scheduled_tokens)


def test_a_request_whose_rounds_are_in_flight_waits_when_speculation_switches_off() -> None:
    """With rounds a speculative step emits an unknown number of tokens even without drafts
    (the worker verifies its own proposals again): when b's arrival switches speculation off
    (2 > 1) while a's step is in flight, the plain plan made before a's result must not
    schedule a. (It did, as a decode of one token: the worker, which had a's tokens of both
    rounds, then sampled nothing for a, and a waited for that token forever.)"""
    from pagedserve.config import SpeculativeConfig

    spec = SpeculativeConfig(num_speculative_tokens=2, method="ngram", num_rounds=2,
                             disable_by_batch_size=1)  # fmt: skip
    sched = Scheduler(make_config(max_num_batched_tokens=64, speculative_config=spec), 64)
    sched.add_request(add("a", [3, 4, 5, 6, 7, 8, 9, 10], max_tokens=20))
    prefill = sched.schedule()
    assert prefill is not None and prefill.propose
    a = handle_of(sched, "a")
    sched.update_from_result(
        StepResult(step_id=prefill.step_id, handles=[a], sampled_token_ids=[11])
    )
    decode = sched.schedule()  # no proposals came back: no drafts, but rounds
    assert decode is not None and decode.propose and decode.spec_token_ids == [[]]
    sched.add_request(add("b", [5, 6, 7]))
    admit_b = sched.schedule()
    assert admit_b is not None and not admit_b.propose
    assert admit_b.scheduled == [handle_of(sched, "b")]
    # a's step verified no drafts, then a round of its own 2 proposals: 1 + 2 tokens
    sched.update_from_result(
        StepResult(
            step_id=decode.step_id,
            handles=[a],
            sampled_token_ids=[12, 13, 14],
            num_sampled=[3],
            num_verifies=[2],
            verify_drafts=[0, 2],
            verify_emitted=[1, 2],
            draft_token_ids=[[15, 16]],
        )  # fmt: skip
    )
    req = sched.requests[a]
    assert req.token_ids[8:] == [11, 12, 13, 14] and req.num_inflight == 0
    assert req.num_computed_tokens == req.num_tokens - 1  # only its last token to compute
    after = sched.schedule()
    assert after is not None and a in after.scheduled and not after.propose


# ---------------------------------------------------------------- the columnar fast path


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("depth", [1, 3])
def test_bulk_decode_steps_plan_and_apply_exactly_as_the_loop(
    seed: int, depth: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same workload (stops, min_tokens, logprobs, aborts, preemption, prefix caching)
    run twice, once with the columnar fast path taking every step it can and once with the
    per-request loop only: the same plans, byte for byte, and the same outputs."""
    from pagedserve.actors import bus
    from pagedserve.actors.scheduler import decode_path

    rng = random.Random(seed)
    arrivals = random_workload(rng, 24)
    cfg = make_config(
        max_model_len=40, max_num_batched_tokens=rng.choice([20, 64]), max_num_seqs=8,
        enable_prefix_caching=seed % 3 != 0,
    )  # fmt: skip
    aborts = {rng.randrange(5, 60): [f"q{rng.randrange(24)}"] for _ in range(3)}
    num_blocks = 12 if seed % 2 else 200  # under pressure: preemption
    taken = {"plan": 0, "result": 0}

    def counted(name: str, function):  # type: ignore[no-untyped-def]
        def call(*args):  # type: ignore[no-untyped-def]
            outcome = function(*args)
            taken[name] += outcome is not None
            return outcome

        return call

    runs = []
    for fast in (True, False):
        with monkeypatch.context() as patch:
            if fast:
                patch.setattr(
                    decode_path, "plan_running", counted("plan", decode_path.plan_running)
                )
                patch.setattr(
                    decode_path, "apply_result", counted("result", decode_path.apply_result)
                )
            else:
                patch.setattr(decode_path, "plan_running", lambda *args: None)
                patch.setattr(decode_path, "apply_result", lambda *args: None)
            plans: list[StepPlan] = []
            sched = Scheduler(cfg, num_blocks)
            out = run_engine(sched, arrivals, depth, random.Random(seed), aborts, plans)
            runs.append((out, [bus.encode(p) for p in plans], sched.stats()))
    assert runs[0] == runs[1]
    assert taken["plan"] > 10 and taken["result"] > 10  # the fast path did take steps


def test_a_step_of_many_running_decodes_takes_the_fast_path_both_ways(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """64 running decodes: the plan is made and its result applied in bulk (the per-request
    loops are never called); the requests that end with this token (EOS, a stop token id,
    max_tokens) finish alone, one whose EOS comes before min_tokens goes on, and one aborted
    while its step was in flight gets no token."""
    sched = Scheduler(make_config(max_num_seqs=64, max_num_batched_tokens=512), 512)
    special = {5: {"max_tokens": 2}, 7: {"stop_token_ids": [9]}, 8: {"min_tokens": 3}}
    for i in range(64):
        admit(sched, add(f"r{i}", [2 + i % 7] * 6, **special.get(i, {"max_tokens": 20})))
    step(sched, {f"r{i}": 11 for i in range(64)})  # the prefill: every request samples

    def loop(*args: object) -> None:
        raise AssertionError("a step of running decodes went through the per-request loop")

    monkeypatch.setattr(Scheduler, "_schedule_running", loop)
    monkeypatch.setattr(Scheduler, "_apply_tokens", loop)
    plan = sched.schedule()
    assert plan is not None and not plan.new_requests
    assert len(plan.cached_requests.num_computed_tokens) == len(plan.scheduled) == 64
    assert plan.num_scheduled_tokens == [1] * 64
    assert plan.cached_requests.num_computed_tokens == [6] * 64
    abort(sched, ["r3"])
    names = labels(sched, plan.scheduled)
    tokens = {"r4": EOS, "r7": 9, "r8": EOS}
    sampled = [tokens.get(name, 12) for name in names]
    result = StepResult(step_id=plan.step_id, handles=plan.scheduled, sampled_token_ids=sampled)
    outs = {label_of(sched, o.handle): o for o in sched.update_from_result(result)}
    assert len(outs) == 63 and "r3" not in outs
    ended = {
        n: (o.finish_reason, o.stop_reason) for n, o in outs.items() if o.finish_reason is not None
    }
    assert ended == {
        "r4": (FinishReason.STOP, None),
        "r5": (FinishReason.LENGTH, None),
        "r7": (FinishReason.STOP, 9),
    }
    assert all(o.new_token_ids == [tokens.get(n, 12)] for n, o in outs.items())
    assert len(sched.running) == 60 and sched.stats().num_generation_tokens == 64 + 63
