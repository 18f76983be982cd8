"""Speculation switched off by the batch size (disable_by_batch_size) costs what plain decoding
costs: above the threshold the scheduler plans exactly what a plain engine plans (its columnar
fast path included: no lookahead slots, no drafts) and the worker runs plain steps (the static
decode path; no verify, no proposer, no draft model)."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedserve.actors import bus
from pagedserve.actors.messages import AddRequest, SamplingParams, StepPlan, StepResult
from pagedserve.actors.scheduler import decode_path
from pagedserve.actors.scheduler.scheduler import Scheduler
from pagedserve.actors.worker import model_runner as model_runner_module
from pagedserve.actors.worker import startup
from pagedserve.actors.worker.model_runner import ModelRunner
from pagedserve.config import EngineConfig, SpeculativeConfig
from tests.test_scheduler import make_config, random_workload, run_engine
from tests.tiny_models import random_prompts, save_tiny_model

NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("spec", ["ngram", "draft-rounds"])
def test_plans_above_the_threshold_are_a_plain_engines(
    seed: int, spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A random workload (stops, aborts, preemption, prefix caching, chunked prefills) with
    speculation configured but never on (every step holds more than 0 requests): the same
    plans, byte for byte, and outputs as without it, the fast path taking steps."""
    rng = random.Random(seed)
    arrivals = random_workload(rng, 24)
    config = SpeculativeConfig(disable_by_batch_size=0, **NGRAM)
    if spec == "draft-rounds":  # lookahead slots: a draft model's k, and further rounds
        config = SpeculativeConfig(model="draft", num_speculative_tokens=3, num_rounds=2,
                                   disable_by_batch_size=0)  # fmt: skip
    original = decode_path.plan_running
    budget = rng.choice([20, 64])
    runs = []
    for speculative in (False, True):
        taken = []

        def plan_running(*args: object, taken: list = taken) -> object:
            outcome = original(*args)
            taken.append(outcome is not None)
            return outcome

        monkeypatch.setattr(decode_path, "plan_running", plan_running)
        cfg = make_config(max_model_len=40, max_num_batched_tokens=budget,
                          enable_prefix_caching=seed % 2 == 0,
                          speculative_config=config if speculative else None)  # fmt: skip
        plans: list[StepPlan] = []
        sched = Scheduler(cfg, 12 if seed % 2 else 200)
        outputs = run_engine(sched, arrivals, 2, random.Random(seed), {}, plans)
        runs.append((outputs, [bus.encode(p) for p in plans], sched.stats(), sum(taken)))
    assert runs[1] == runs[0]
    assert runs[1][3] > 10  # the fast path planned steps


def drive(sched: Scheduler, runner: ModelRunner, depth: int = 3) -> tuple[list[bytes], list]:
    """Run the scheduler's plans on the runner as the actors do (up to `depth` plans at the
    worker, each result as the worker reports it); the plans and the outputs."""
    plans, outputs, queued = [], [], deque()
    while sched.requests or queued:
        while len(queued) < depth and (plan := sched.schedule()) is not None:
            queued.append(plan)
            plans.append(bus.encode(plan))
        result: StepResult | None = runner.launch(queued.popleft()) if queued else runner.finish()
        if result is not None:
            outputs += [(o.handle, o.new_token_ids) for o in sched.update_from_result(result)]
    return plans, outputs


def runner_of(target: Path, spec: SpeculativeConfig | None, num_blocks: int, max_num_seqs: int
              ) -> tuple[EngineConfig, ModelRunner]:  # fmt: skip
    """A CPU ModelRunner of `target` with its KV cache (and `spec`, if any), and its config."""
    config = EngineConfig(model=str(target), num_kv_blocks=num_blocks, max_num_seqs=max_num_seqs,
                          skip_tokenizer_init=True, speculative_config=spec).resolve()  # fmt: skip
    runner = ModelRunner(config)
    runner.load_model()
    startup.init_kv_cache(runner, num_blocks)
    return config, runner


def recording(function: Callable[..., bool], calls: list[bool]) -> Callable[..., bool]:
    def call(*args: object) -> bool:
        calls.append(function(*args))
        return calls[-1]

    return call


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_steps_above_the_threshold_are_a_plain_engines(
    proposer: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """12 requests of one length limit, all admitted at once, above disable_by_batch_size 4
    until they all end: the same plans, tokens and paths (the static decode path) as a plain
    engine; the proposer and the draft model never run."""
    target = save_tiny_model("llama", tmp_path / "target")
    draft = save_tiny_model("llama", tmp_path / "draft", seed=1, hidden_size=32)
    spec = SpeculativeConfig(disable_by_batch_size=4, **NGRAM)
    if proposer == "draft":
        spec = SpeculativeConfig(model=str(draft), num_speculative_tokens=3,
                                 disable_by_batch_size=4)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = random_prompts(400, [3, 9, 17, 30] * 3, seed=2)
    runs = []
    for speculative in (False, True):
        config, runner = runner_of(target, spec if speculative else None, 128, 16)
        if speculative:

            def refuse(*args: object) -> None:
                raise AssertionError("a step above the threshold speculated")

            monkeypatch.setattr(model_runner_module, "speculative_step", refuse)
            for name in ("observe", "propose", "propose_after_verify"):
                monkeypatch.setattr(runner.proposer, name, refuse)
        decodes: list[bool] = []  # the static decode path's steps
        monkeypatch.setattr(runner, "_is_decode_step", recording(runner._is_decode_step, decodes))
        sched = Scheduler(config, 128)
        for seq, prompt in enumerate(prompts):
            sched.add_request(AddRequest(client=b"c", seq=seq, prompt_token_ids=prompt,
                                         sampling=params, eos_token_ids=[]))  # fmt: skip
        runs.append((*drive(sched, runner), decodes))
    assert runs[1] == runs[0]
    assert sum(runs[1][2]) >= 10  # every decode step took the static path


def drive_with_arrivals(sched: Scheduler, runner: ModelRunner, waves: list[list[AddRequest]]
                        ) -> list:  # fmt: skip
    """Like `drive` with one plan at the worker (the next plan then holds every request, the
    new ones too), each wave of requests added once the requests before it have run 3 steps;
    the outputs."""
    outputs, queued, steps = [], deque(), 0
    while sched.requests or queued or waves:
        if waves and (steps % 3 == 0 or not sched.requests):
            for add_request in waves.pop(0):
                sched.add_request(add_request)
        if not queued and (plan := sched.schedule()) is not None:
            queued.append(plan)
        result: StepResult | None = runner.launch(queued.popleft()) if queued else runner.finish()
        steps += 1
        if result is not None:
            outputs += [(o.handle, o.new_token_ids) for o in sched.update_from_result(result)]
    return outputs


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculating_steps_with_prompts_run_their_parts_on_the_fast_paths(
    proposer: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests arriving in waves while others speculate: a step of new prompts runs as a
    plain step, and one of prompts and decodes with drafts in two parts (the prompts plain,
    the decodes as a verify), never on the general verify path, which runs the target
    eagerly; every token is a plain engine's."""
    from pagedserve.actors.worker import verify_step

    target = save_tiny_model("llama", tmp_path / "target")
    draft = save_tiny_model("llama", tmp_path / "draft", seed=1, hidden_size=32)
    spec = SpeculativeConfig(**NGRAM)
    if proposer == "draft":
        spec = SpeculativeConfig(model=str(draft), num_speculative_tokens=3)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    passage = random_prompts(400, [10], seed=4)[0]
    prompts = [passage * 3, *random_prompts(400, [9, 17], seed=3), passage * 2, passage[:7]]
    requests = [AddRequest(client=b"c", seq=seq, prompt_token_ids=prompt, sampling=params,
                           eos_token_ids=[]) for seq, prompt in enumerate(prompts)]  # fmt: skip
    general, joined = verify_step._verify_general, verify_step._joined
    runs = []
    for speculative in (False, True):
        config, runner = runner_of(target, spec if speculative else None, 64, 8)
        calls: dict[str, int] = {"general": 0, "joined": 0}

        def counted(name: str, function: Callable, calls: dict[str, int] = calls) -> Callable:
            def call(*args: object) -> object:
                calls[name] += 1
                return function(*args)

            return call

        monkeypatch.setattr(verify_step, "_verify_general", counted("general", general))
        monkeypatch.setattr(verify_step, "_joined", counted("joined", joined))
        sched = Scheduler(config, 64)
        waves = [requests[:1], requests[1:3], requests[3:]]
        outputs = drive_with_arrivals(sched, runner, waves)
        runs.append({h: [t for k, new in outputs if k == h for t in new] for h, _ in outputs})
        if speculative:
            assert calls["general"] == 0
            if proposer == "draft":  # it always drafts: steps of prompts and drafts to verify
                assert calls["joined"] > 0
            assert sched.stats().spec_num_draft_tokens > 0
    assert runs[1] == runs[0]
