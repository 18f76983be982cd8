"""N-gram speculation's rounds on the device (kernels/triton_ngram.py, worker/ngram_rounds.py):
the device's lookup proposes what the host's does; one round's accept, lookup and row writes
are the same in the Triton kernel (Triton's interpreter) and in torch; and through the
scheduler and a ModelRunner, a step's rounds on the device give the tokens of the host's
rounds and of a plain engine, with length limits reached inside a step's rounds and blocks
freed."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from pagedserve.actors.messages import AddRequest, SamplingParams, StepPlan
from pagedserve.actors.scheduler.scheduler import Scheduler
from pagedserve.actors.worker import ngram_rounds, run_ahead, startup, verify_step
from pagedserve.actors.worker.model_runner import ModelRunner
from pagedserve.actors.worker.speculative import NgramProposer
from pagedserve.config import EngineConfig, SpeculativeConfig
from pagedserve.kernels import triton_ngram
from pagedserve.kernels.triton_ngram import Phases, RoundsState, RowFields
from tests.test_spec_switch import drive
from tests.tiny_models import random_prompts, save_tiny_model


def _triton_interpreted() -> bool:
    try:
        import triton.language.standard as tl_standard
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(tl_standard.sum, InterpretedFunction)


def random_state(rng: np.random.Generator, batch: int, k: int, block_size: int) -> RoundsState:
    """Requests of 1-40 tokens over a 4-token vocabulary (n-grams recur), room of -1..k + 2,
    random drafts, block tables of distinct blocks."""
    lengths = rng.integers(1, 41, size=batch)
    columns = 40 + 3 * (k + 1) + 1
    tokens = np.zeros((batch, columns), np.int64)
    for b, n in enumerate(lengths):
        tokens[b, :n] = rng.integers(0, 4, size=n)
        tokens[b, n:] = rng.integers(0, 9, size=columns - n)  # stale tokens past the end
    width = -(-columns // block_size)
    tables = rng.permutation(batch * width).reshape(batch, width).astype(np.int32)
    num_drafts = rng.integers(-1, k + 1, size=batch)
    return RoundsState(
        tokens=torch.from_numpy(tokens), num_tokens=torch.from_numpy(lengths.astype(np.int64)),
        room_end=torch.from_numpy(lengths + rng.integers(-1, k + 3, size=batch)),
        tables=torch.from_numpy(tables), drafts=torch.from_numpy(rng.integers(0, 4, (batch, k))),
        num_drafts=torch.from_numpy(num_drafts.astype(np.int64)),
    )  # fmt: skip


def copy_of(state: RoundsState) -> RoundsState:
    return RoundsState(**{name: t.clone() for name, t in vars(state).items()})


def test_device_lookup_proposes_the_host_lookups_drafts() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        k, min_n = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 3))
        state = random_state(rng, 6, k, 4)
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k,
                                 prompt_lookup_min=min_n, prompt_lookup_max=max_n)  # fmt: skip
        host = NgramProposer(spec)
        drafts, count = triton_ngram.lookup_reference(
            state.tokens, state.num_tokens, k, min_n, max_n
        )
        for b in range(6):
            n = int(state.num_tokens[b])
            expected = host.lookup(state.tokens[b, :n].numpy())
            assert drafts[b, : int(count[b])].tolist() == expected, (
                state.tokens[b, :n],
                k,
                min_n,
                max_n,
            )


def test_a_round_accepts_the_agreeing_prefix_and_writes_the_next_verify() -> None:
    """Request 0 verified drafts 5 6 7 and the target sampled 5 6 9 2: drafts 5 6 are
    accepted and 9 is its own, so 5 6 9 are emitted; request 1 had no room (-1): nothing."""
    tokens = torch.tensor([[1, 2, 3, 0, 0, 0, 0, 0, 0, 0], [4, 4, 4, 4, 0, 0, 0, 0, 0, 0]])
    state = RoundsState(
        tokens=tokens, num_tokens=torch.tensor([3, 4]), room_end=torch.tensor([8, 3]),
        tables=torch.tensor([[2, 7, 1], [3, 4, 5]], dtype=torch.int32),
        drafts=torch.tensor([[5, 6, 7], [0, 0, 0]]), num_drafts=torch.tensor([3, -1]),
    )  # fmt: skip
    samples = torch.tensor([5, 6, 9, 2, 8, 8, 8, 8])
    stats = torch.zeros(2, 6, dtype=torch.int64)
    rows = RowFields(*(torch.zeros(8, dtype=torch.int64) for _ in range(3)),
                     torch.zeros(8, dtype=torch.int32))  # fmt: skip
    triton_ngram.advance(state, Phases(samples, stats, rows, (1, 2)), block_size=4)
    assert state.tokens[0, :6].tolist() == [1, 2, 3, 5, 6, 9]
    assert state.num_tokens.tolist() == [6, 4]
    assert stats.tolist() == [[3, 3, 5, 6, 9, 2], [-1, 0, 8, 8, 8, 8]]
    # request 0: its suffix 9 occurs nowhere before, nor does 6 9; no drafts: one row
    assert state.num_drafts.tolist() == [0, -1]
    assert rows.token_ids.tolist() == [9, 0, 0, 0, 0, 0, 0, 0]
    assert rows.positions.tolist() == [5, 0, 0, 0, 0, 0, 0, 0]
    assert rows.slot_mapping.tolist() == [7 * 4 + 1, -1, -1, -1, -1, -1, -1, -1]
    assert rows.seq_lens.tolist() == [6, 1, 1, 1, 1, 1, 1, 1]


@pytest.mark.skipif(not _triton_interpreted(), reason="triton imported without TRITON_INTERPRET=1")
def test_the_triton_kernel_is_the_torch_reference() -> None:
    rng = np.random.default_rng(1)
    for case in range(40):
        k, block_size = int(rng.integers(1, 6)), int(rng.choice([1, 4, 16]))
        min_n = int(rng.integers(1, 3))
        lookup = None if case % 5 == 0 else (min_n, min_n + int(rng.integers(0, 3)))
        batch = int(rng.integers(1, 5))
        state = random_state(rng, batch, k, block_size)
        accept = case % 3 != 0
        samples = torch.from_numpy(rng.integers(0, 4, size=batch * (k + 1))) if accept else None
        results = []
        for advance in (triton_ngram.advance_reference, triton_ngram.advance_triton):
            run_state = copy_of(state)
            stats = torch.full((batch, k + 3), 99, dtype=torch.int64) if accept else None
            rows = RowFields(*(torch.full((batch * (k + 1) + 2,), 77) for _ in range(3)),
                             torch.full((batch * (k + 1) + 2,), 77, dtype=torch.int32))  # fmt: skip
            advance(run_state, Phases(samples, stats, rows, lookup), block_size)
            live = run_state.num_drafts.clone()
            drafts = [run_state.drafts[b, : max(int(d), 0)].tolist() for b, d in enumerate(live)]
            ends = [
                run_state.tokens[b, : int(n)].tolist() for b, n in enumerate(run_state.num_tokens)
            ]
            results.append((ends, live.tolist(), drafts, stats, vars(rows)))
        reference, kernel = results
        assert kernel[:3] == reference[:3], case
        if accept:
            assert torch.equal(kernel[3], reference[3]), case
        for name, value in reference[4].items():
            assert torch.equal(kernel[4][name], value), (case, name)


def small_runner(target: Path, spec: SpeculativeConfig | None) -> tuple[EngineConfig, ModelRunner]:
    """A CPU runner of 14 KV blocks of 16 tokens, 4 requests at most, max_model_len 64."""
    config = EngineConfig(model=str(target), num_kv_blocks=14, max_num_seqs=4, max_model_len=64,
                          skip_tokenizer_init=True, speculative_config=spec).resolve()  # fmt: skip
    runner = ModelRunner(config)
    runner.load_model()
    startup.init_kv_cache(runner, 14)
    return config, runner


def counted(function: Callable, calls: list[int]) -> Callable:
    def call(*args: object) -> object:
        calls.append(1)
        return function(*args)

    return call


@pytest.mark.parametrize("seed", range(2))
def test_rounds_on_the_device_give_the_host_rounds_and_a_plain_engines_tokens(
    seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copy-heavy and random prompts, greedy, max_tokens that end requests inside a step's
    rounds, few KV blocks (preemption) and max_model_len 64 (length limits): the same tokens
    with the rounds on the device, with them on the host (where rounds without drafts run
    ahead of the lookups), and without speculation; every block free at the end."""
    target = save_tiny_model("llama", tmp_path / "target")
    host = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                             prompt_lookup_max=3, num_rounds=4)  # fmt: skip
    device = msgspec.structs.replace(host, rounds_on_device=True)
    rng = random.Random(seed)
    # copy-heavy prompts: a step runs its rounds on the device only when every request in it
    # has drafts (rounds_run_on_device); a random one, later, takes the host's loop
    passage, other, random_prompt = random_prompts(400, [8, 6, 20], seed=seed)
    prompts = [passage * 4, passage * 2 + passage[:3], other * 3, random_prompt]
    limits = [rng.choice([5, 11, 40, 64]) for _ in prompts]
    original = ngram_rounds.every_request_drafts
    runs, device_calls, ahead_calls = {}, [], []
    decode_one = run_ahead._decode_one

    def counted_ahead(runner, rows, feed_index):  # noqa: ANN001, ANN202
        ahead_calls.extend([1] * bool((feed_index >= 0).all()))  # fed: a round run ahead
        return decode_one(runner, rows, feed_index)

    monkeypatch.setattr(run_ahead, "_decode_one", counted_ahead)
    specs = {"plain": None, "host": host, "device": device, "device where all draft": device}
    for name, spec in specs.items():
        monkeypatch.setattr(verify_step, "device_rounds",
                            counted(ngram_rounds.device_rounds, device_calls))  # fmt: skip
        # "device": every decode-shaped step's rounds on the device, drafts or not
        forced = name == "device"
        monkeypatch.setattr(ngram_rounds, "every_request_drafts",
                            lambda *args, forced=forced: forced or original(*args))  # fmt: skip
        config, runner = small_runner(target, spec)
        sched = Scheduler(config, 14)
        for seq, (prompt, limit) in enumerate(zip(prompts, limits)):
            params = SamplingParams(temperature=0.0, max_tokens=limit, ignore_eos=True)
            sched.add_request(AddRequest(client=b"c", seq=seq, prompt_token_ids=prompt,
                                         sampling=params, eos_token_ids=[]))  # fmt: skip
        calls_before = len(device_calls)
        _, outputs = drive(sched, runner)
        runs[name] = {h: [t for k, new in outputs if k == h for t in new] for h, _ in outputs}
        stats = sched.stats()
        assert stats.num_free_blocks == stats.num_total_blocks, name
        if name == "device":
            assert len(device_calls) > calls_before + 3
            assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
        elif name != "device where all draft":
            assert len(device_calls) == calls_before
        if name == "host":  # rounds without drafts ran ahead of the host's lookups
            assert len(ahead_calls) > 3
    assert runs["host"] == runs["plain"]
    assert runs["device"] == runs["plain"]
    assert runs["device where all draft"] == runs["plain"]


def test_a_step_runs_its_rounds_on_the_device_when_every_request_has_drafts() -> None:
    plan = StepPlan(step_id=1, scheduled=[7, 8], num_scheduled_tokens=[3, 2],
                    spec_token_ids=[[4, 5], [6]])  # fmt: skip
    rows = np.array([0, 1])
    assert ngram_rounds.every_request_drafts(plan, rows)
    plan.spec_token_ids = [[4, 5], []]
    assert not ngram_rounds.every_request_drafts(plan, rows)
    plan.spec_token_ids = []
    assert not ngram_rounds.every_request_drafts(plan, rows)
