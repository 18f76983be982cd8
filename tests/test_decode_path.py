"""The static decode path (actors/worker/cuda_graphs.py, decode_buffers.py): decode steps read
their inputs from one static buffer, take the previous step's sampled ids on the device, and
argmax in place; on a GPU the same function is a CUDA graph. On the CPU it runs eagerly and
must give exactly the results of the general step path, also with padded rows (as graphs run)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from pagedserve.actors.messages import SamplingParams, StepPlan, StepResult
from pagedserve.actors.worker import startup
from pagedserve.actors.worker.decode_buffers import DecodeBuffers, DecodeLayout
from pagedserve.actors.worker.model_runner import ModelRunner
from pagedserve.config import EngineConfig
from tests.test_model_parity import (
    MAX_NEW_TOKENS,
    NUM_BLOCKS,
    MiniScheduler,
    RecordingRunner,
    make_runner,
    random_prompts,
    save_hf_model,
)


def test_layout_views_alias_one_buffer_with_each_fields_dtype() -> None:
    layout = DecodeLayout(max_batch=5, max_blocks=3)
    assert all(offset % 16 == 0 for offset in layout.offsets.values())
    buffer = np.zeros(layout.nbytes, np.uint8)
    host = layout.numpy_views(buffer)
    device = layout.tensor_views(torch.from_numpy(buffer))
    host.token_ids[:] = np.arange(5) + 10**10  # needs 64 bits
    host.feed_index[:] = -1
    host.positions[:] = np.arange(5) * 3
    host.slot_mapping[:] = np.arange(5) * 7
    host.seq_lens[:] = np.arange(5) + 1
    host.block_tables[:] = np.arange(15).reshape(5, 3)
    assert device.token_ids.dtype == torch.int64 and device.seq_lens.dtype == torch.int32
    assert device.block_tables.shape == (5, 3) and device.block_tables.dtype == torch.int32
    for name in ("token_ids", "feed_index", "positions", "slot_mapping", "seq_lens"):
        np.testing.assert_array_equal(getattr(device, name).numpy(), getattr(host, name))
    np.testing.assert_array_equal(device.block_tables.numpy(), np.arange(15).reshape(5, 3))
    # the used prefix: every small field whole, then the first two block-table rows
    assert layout.used_bytes(2) == layout.offsets["block_tables"] + 2 * 3 * 4
    assert layout.used_bytes(5) == layout.nbytes


def test_padding_rows_write_no_kv_and_attend_one_key() -> None:
    buffers = DecodeBuffers(max_batch=4, max_blocks=2, device=torch.device("cpu"))
    host = buffers.staging()
    host.slot_mapping[:] = 5
    host.seq_lens[:] = 9
    host.feed_index[:] = 0
    host.pad(1, 4)
    assert host.slot_mapping.tolist() == [5, -1, -1, -1]
    assert host.seq_lens.tolist() == [9, 1, 1, 1]
    assert host.feed_index.tolist() == [0, -1, -1, -1]
    assert buffers.tensors.slot_mapping.tolist() == [5, -1, -1, -1]  # CPU: staging is the buffer


def record_plans(tmp_path: Path, params: SamplingParams) -> RecordingRunner:
    """Plans and results of the general step path (the static decode path switched off)."""
    runner = make_runner(tmp_path)
    runner.decode_step = None
    recording = RecordingRunner(runner)
    MiniScheduler(random_prompts(seed=11), params).run(recording)  # type: ignore[arg-type]
    return recording


def with_sampling(plan: StepPlan, params: SamplingParams) -> StepPlan:
    new = [msgspec.structs.replace(r, sampling=params) for r in plan.new_requests]
    return msgspec.structs.replace(plan, new_requests=new)


def replay_pipelined(runner: ModelRunner, plans: list[StepPlan]) -> list[StepResult]:
    """launch(N + 1) before finish(N), as the worker runs steps."""
    results = []
    for plan in plans:
        previous = runner.launch(plan)
        if previous is not None:
            results.append(previous)
    last = runner.finish()
    assert last is not None
    return results + [last]


def count_decode_steps(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The step ids of the plans that take the static decode path."""
    calls: list[int] = []
    original = runner._is_decode_step

    def spy(plan, rows, pending_index):  # type: ignore[no-untyped-def]
        is_decode = original(plan, rows, pending_index)
        if is_decode:
            calls.append(plan.step_id)
        return is_decode

    monkeypatch.setattr(runner, "_is_decode_step", spy)
    return calls


SAMPLINGS = {
    "greedy-logprobs": SamplingParams(temperature=0.0, logprobs=2, max_tokens=MAX_NEW_TOKENS),
    "seeded-top-k": SamplingParams(
        temperature=0.8, top_k=20, seed=3, logprobs=0, max_tokens=MAX_NEW_TOKENS
    ),
}


@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded"])
@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
def test_static_decode_steps_match_the_general_path(
    tmp_path: Path, sampling: str, padded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps through the static path (pipelined: fed tokens come from the device) give
    the general path's tokens and logprobs; `padded` runs every decode step at the buffers'
    full batch, as a CUDA graph of a larger size would."""
    save_hf_model("qwen3", tmp_path)
    recording = record_plans(tmp_path, SAMPLINGS[sampling])
    runner = make_runner(tmp_path)
    assert runner.decode_step is not None
    if padded:
        full = runner.decode_step.max_batch
        monkeypatch.setattr(runner.decode_step, "padded_size", lambda batch: full)
    decode_steps = count_decode_steps(runner, monkeypatch)
    results = replay_pipelined(runner, recording.plans)
    assert len(decode_steps) > MAX_NEW_TOKENS // 2  # most steps are pure decode steps
    for got, expected in zip(results, recording.results, strict=True):
        assert got.step_id == expected.step_id and got.handles == expected.handles
        assert got.sampled_token_ids == expected.sampled_token_ids
        assert got.logprobs == expected.logprobs


@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
def test_prompt_chunks_as_static_rows_match_the_general_path(
    tmp_path: Path, sampling: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With static_prefill (on where the path's graphs were captured: a GPU), prompt chunks
    and mixed steps run as rows of the static decode path too (static_rows.py), pipelined,
    only each request's last row sampling: the general path's tokens, and its logprobs to
    float tolerance (the decode kernels instead of the prefill ones)."""
    save_hf_model("qwen3", tmp_path)
    recording = record_plans(tmp_path, SAMPLINGS[sampling])
    config = EngineConfig(model=str(tmp_path), num_kv_blocks=NUM_BLOCKS, max_num_seqs=256)
    runner = ModelRunner(config.resolve())  # rows for the longest prompt
    runner.load_model()
    startup.init_kv_cache(runner, NUM_BLOCKS)
    runner.static_prefill = True
    static_steps = count_decode_steps(runner, monkeypatch)
    results = replay_pipelined(runner, recording.plans)
    chunks = [p for p in recording.plans if max(p.num_scheduled_tokens, default=1) > 1]
    assert chunks and all(p.step_id in static_steps for p in recording.plans if p.scheduled)
    assert any(len(r.handles) < len(p.scheduled) for p, r in zip(recording.plans, results))
    for got, expected in zip(results, recording.results, strict=True):
        assert got.step_id == expected.step_id and got.handles == expected.handles
        assert got.sampled_token_ids == expected.sampled_token_ids
        for a, b in zip(got.logprobs or [], expected.logprobs or [], strict=True):
            assert (a.token_id, a.rank, a.top_token_ids) == (b.token_id, b.rank, b.top_token_ids)
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-4)


def test_plain_greedy_decode_takes_the_in_step_argmax(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy rows without logprobs or penalties skip the sampler: the step's own argmax (left
    in the runner's `sampled` buffer) is the token, the same as the sampler's greedy token."""
    save_hf_model("llama", tmp_path)
    recording = record_plans(tmp_path, SAMPLINGS["greedy-logprobs"])
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    plans = [with_sampling(plan, plain) for plan in recording.plans]
    runner = make_runner(tmp_path)
    sampler_calls: list[int] = []
    original_sampler = runner.sampler
    monkeypatch.setattr(
        runner, "sampler", lambda *a: sampler_calls.append(1) or original_sampler(*a)
    )
    decode_steps = count_decode_steps(runner, monkeypatch)
    results = replay_pipelined(runner, plans)
    sampling_steps = [r.step_id for r in results if r.handles]
    general_steps = [step_id for step_id in sampling_steps if step_id not in decode_steps]
    assert len(sampler_calls) == len(general_steps) < len(decode_steps)  # prefill steps only
    for got, expected in zip(results, recording.results, strict=True):
        assert got.sampled_token_ids == expected.sampled_token_ids and got.logprobs is None


def test_dry_run_leaves_the_runner_as_it_was(tmp_path: Path) -> None:
    """The start-up's compile-only dry run (here run for real, on the CPU) leaves no request,
    no KV and no sampling state behind: later steps give the results of a fresh runner."""
    save_hf_model("qwen3", tmp_path)
    params = SAMPLINGS["seeded-top-k"]
    expected = record_plans(tmp_path, params)
    runner = make_runner(tmp_path)
    runner.decode_step = None  # compare with the recording's path
    startup.dry_run(runner)
    assert len(runner.input_batch) == 0 and runner.pending is None
    assert all(layer.k_cache.data_ptr() == runner.kv_cache[i, 0].data_ptr()  # type: ignore[index]
               for i, layer in enumerate(runner.attention_layers))  # fmt: skip
    for plan, result in zip(expected.plans, expected.results, strict=True):
        got = runner.execute(plan)
        assert got.sampled_token_ids == result.sampled_token_ids


@pytest.mark.parametrize(
    "limits",
    [
        {"max_num_seqs": 1},
        {"max_model_len": 40, "max_num_seqs": 4},
        {"max_model_len": 64, "max_num_batched_tokens": 16},
        {"max_model_len": 8, "max_num_seqs": 2},
    ],
    ids=["one-sequence", "short-model-len", "small-token-budget", "tiny-model-len"],
)
def test_start_up_steps_fit_the_engines_limits(tmp_path: Path, limits: dict[str, int]) -> None:
    """The start-up's synthetic steps (the CUDA warm-up's mixed steps, the dry run) stay within
    max_num_seqs, max_model_len and the token budget (a GPU engine with a smaller limit than
    the warm-up's chunk of 128 tokens, or one sequence, failed to start), and leave the runner
    empty."""
    save_hf_model("qwen3", tmp_path)
    runner = make_runner(tmp_path, **limits)
    config = runner.config
    plans = startup._warm_up_plans(runner, startup.num_kv_blocks(runner) * runner.block_size)
    assert plans
    for plan, _ in plans:
        assert len(plan.new_requests) <= config.max_num_seqs
        assert sum(plan.num_scheduled_tokens) <= config.max_num_batched_tokens
        assert all(len(r.token_ids) <= config.max_model_len for r in plan.new_requests)
    startup.warm_up_eager_kernels(runner, startup.num_kv_blocks(runner))
    startup.dry_run(runner)
    assert len(runner.input_batch) == 0


def test_compile_only_turns_triton_launches_into_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside compile_only() a launch reaches Triton's JITFunction.run as a warmup (compile,
    no launch) with Triton's AsyncCompileMode active; outside, launches are untouched."""
    from triton.runtime import _async_compile
    from triton.runtime.jit import JITFunction

    from pagedserve.kernels import compile_ahead

    calls: list[tuple[bool, bool]] = []

    def recording_run(self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((warmup, _async_compile.active_mode.get() is not None))

    monkeypatch.setattr(JITFunction, "run", recording_run)
    kernel = object.__new__(JITFunction)
    with compile_ahead.compile_only(max_workers=2):
        kernel[(1,)]()
    kernel[(1,)]()
    assert calls == [(True, True), (False, False)]
    assert JITFunction.run is recording_run


class _CapturingStep:
    def __init__(self) -> None:
        self.captured = 0
        self.graphs: dict = {}

    def capture(self) -> None:
        self.captured += 1


@pytest.mark.parametrize(("graph_safe", "enforce_eager", "captured"),
                         [(True, False, 1), (False, False, 0), (True, True, 0)])  # fmt: skip
def test_a_graph_safe_backend_on_a_gpu_captures_the_decode_step(
    graph_safe: bool, enforce_eager: bool, captured: int
) -> None:
    """The decode step is captured as CUDA graphs exactly when the device is a GPU, the
    attention backend (an object chosen at load) is graph-safe and enforce_eager is off."""
    from types import SimpleNamespace

    from pagedserve.kernels.attention_backends import AttentionBackend

    step = _CapturingStep()
    backend = AttentionBackend("triton", attend=None, write_kv_cache=None,  # type: ignore[arg-type]
                               graph_safe=graph_safe)  # fmt: skip
    runner = SimpleNamespace(
        new_decode_step=lambda: step, attention_backend=backend, proposer=None,
        device=torch.device("cuda"), config=SimpleNamespace(enforce_eager=enforce_eager),
    )  # fmt: skip
    startup._build_decode_step(runner)  # type: ignore[arg-type]
    assert runner.decode_step is step and step.captured == captured
