"""A lone request's prompt chunk through the prefill graphs' forward (prefill_graphs.py), run
eagerly on the CPU at the graphs' padded sizes: the first token and the decode after it equal
the general step path's (greedy and seeded sampling), for several lengths and for a chunk
after a prefix-cache hit (it starts at position n > 0)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.actors.messages import NewRequestData, SamplingParams, StepPlan
from pagedserve.actors.worker import startup
from pagedserve.actors.worker.model_runner import ModelRunner
from pagedserve.config import EngineConfig
from tests.test_model_parity import NUM_BLOCKS, save_hf_model

SIZES = (16, 32, 128)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
SEEDED = SamplingParams(temperature=0.9, top_k=20, seed=5, logprobs=1, max_tokens=4)


def runner_for(path: Path, prefill_graphs: bool, max_num_seqs: int = 128) -> ModelRunner:
    config = EngineConfig(model=str(path), num_kv_blocks=NUM_BLOCKS, max_num_seqs=max_num_seqs,
                          prefill_graph_sizes=SIZES)  # fmt: skip
    runner = ModelRunner(config.resolve())
    runner.load_model()
    startup.init_kv_cache(runner, NUM_BLOCKS)
    if prefill_graphs:  # as startup.py sets it where the graphs are captured (a GPU)
        runner.prefill_step = runner.new_prefill_step()
    return runner


def generate(runner: ModelRunner, prompt: list[int], params: SamplingParams,
             cached: int = 0) -> tuple[list[int], list]:  # fmt: skip
    """The prompt's first token, then 3 decodes; `cached` tokens are computed beforehand (a
    prefix-cache hit: the first plan's chunk starts there)."""
    blocks = list(range(8))
    new = NewRequestData(1, prompt, len(prompt), params, 1, blocks, 0)
    if cached:
        runner.execute(StepPlan(step_id=0, new_requests=[new], scheduled=[1],
                                num_scheduled_tokens=[cached]))  # fmt: skip
        plan = StepPlan(step_id=1, scheduled=[1], num_scheduled_tokens=[len(prompt) - cached])
    else:
        plan = StepPlan(step_id=1, new_requests=[new], scheduled=[1],
                        num_scheduled_tokens=[len(prompt)])  # fmt: skip
    tokens, logprobs = [], []
    for step_id in range(2, 6):
        result = runner.execute(plan)
        tokens += result.sampled_token_ids
        logprobs += result.logprobs or []
        plan = StepPlan(step_id=step_id, scheduled=[1], num_scheduled_tokens=[1])
    return tokens, logprobs


@pytest.mark.parametrize(("arch", "max_num_seqs"), [("llama", 128), ("qwen3", 128), ("llama", 2)])
def test_lone_prompts_match_the_general_path(arch: str, max_num_seqs: int, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Every size whatever max_num_seqs is: the graphs' rows are not the decode batch's (an
    engine of max_num_seqs 8 ran a 128-token prompt eagerly: ~12 ms of launches on an H100)."""
    save_hf_model(arch, tmp_path)
    plain = runner_for(tmp_path, False, max_num_seqs)
    graphs = runner_for(tmp_path, True, max_num_seqs)
    taken: list[int] = []
    assert graphs.prefill_step is not None
    original = graphs.prefill_step.forward
    monkeypatch.setattr(graphs.prefill_step, "forward",
                        lambda size, *a: taken.append(size) or original(size, *a))  # fmt: skip
    cases = [(length, 0, GREEDY) for length in (1, 7, 16, 17, 100)]
    cases += [(40, 32, GREEDY), (23, 0, SEEDED), (40, 32, SEEDED)]
    for length, cached, params in cases:
        prompt = [(7 * i + length) % 90 + 3 for i in range(length)]
        taken.clear()
        expected = generate(plain, prompt, params, cached)
        got = generate(graphs, prompt, params, cached)
        assert got[0] == expected[0], (length, cached)
        for a, b in zip(got[1], expected[1], strict=True):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        chunks = [n for n in (cached, length - cached) if n > 1]  # a lone token: decode path
        assert taken == [min(s for s in SIZES if s >= n) for n in chunks], length
        for runner in (plain, graphs):
            runner.execute(StepPlan(step_id=9, finished=[1]))
