"""A draft model's proposals in the worker (draft_chain.py): k greedy decodes of the draft on the
device, started from the host's tokens after a prefill step, or from a verify step's samples on
the device after a verify run as a decode step. Either way the proposals are the draft model's
own greedy continuation of the request's tokens (transformers is the oracle) and the emitted
tokens are the target's greedy ones: with a different draft (drafts often rejected, the draft's
KV rolled back) and with the target drafting for itself (every draft accepted: the chain must
first read the last draft, which it never read)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pagedserve.actors.messages import CachedRequestData, NewRequestData, SamplingParams, StepPlan
from pagedserve.actors.worker import startup
from pagedserve.actors.worker.model_runner import ModelRunner
from pagedserve.config import EngineConfig, SpeculativeConfig
from tests.tiny_models import random_prompts, save_tiny_model

K = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
BLOCKS_PER_REQUEST = 4  # of 16 tokens: room for the prompt, the steps and the lookahead


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        "target": save_tiny_model("llama", tmp_path_factory.mktemp("target")),
        "draft": save_tiny_model("llama", tmp_path_factory.mktemp("draft"), seed=1, hidden_size=32),
    }


def greedy_continuation(
    model: transformers.PreTrainedModel, tokens: list[int], n: int
) -> list[int]:
    sequence = list(tokens)
    with torch.inference_mode():
        for _ in range(n):
            sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
    return sequence[len(tokens) :]


def make_runner(target: Path, draft: Path) -> ModelRunner:
    spec = SpeculativeConfig(model=str(draft), num_speculative_tokens=K)
    config = EngineConfig(
        model=str(target), num_kv_blocks=64, max_num_seqs=4, speculative_config=spec,
        skip_tokenizer_init=True,
    ).resolve()  # fmt: skip
    runner = ModelRunner(config)
    runner.load_model()
    startup.init_kv_cache(runner, 64)
    return runner


@pytest.mark.parametrize("draft_name", ["draft", "target"], ids=["other-draft", "self-draft"])
def test_drafts_are_the_draft_models_greedy_continuation(
    models: dict[str, Path], draft_name: str
) -> None:
    runner = make_runner(models["target"], models[draft_name])
    hf = {
        name: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        for name, path in models.items()
    }
    host_proposals = []
    original_propose = runner.proposer.propose
    runner.proposer.propose = lambda *a: host_proposals.append(1) or original_propose(*a)
    prompts = random_prompts(400, [5, 11], seed=3)
    handles = [10, 11]
    tokens = {h: list(p) for h, p in zip(handles, prompts)}
    new = [
        NewRequestData(h, list(p), len(p), GREEDY, i, list(range(4 * i, 4 * i + 4)), 0)
        for i, (h, p) in enumerate(zip(handles, prompts))
    ]
    plan = StepPlan(
        step_id=0, new_requests=new, scheduled=handles,
        num_scheduled_tokens=[len(p) for p in prompts], spec_token_ids=[[], []], propose=True,
    )  # fmt: skip
    computed = {h: len(p) for h, p in zip(handles, prompts)}
    accepted_total = 0
    for step in range(1, 7):
        result = runner.execute(plan)
        counts = result.num_sampled or [1] * len(handles)
        start = 0
        for i, (handle, count) in enumerate(zip(result.handles, counts)):
            emitted = result.sampled_token_ids[start : start + count]
            start += count
            assert emitted == greedy_continuation(hf["target"], tokens[handle], count)
            tokens[handle] += emitted
            accepted_total += count - 1
            if step > 1:
                computed[handle] += count
            drafts = result.draft_token_ids[i]
            assert drafts == greedy_continuation(hf[draft_name], tokens[handle], K)
        drafts = result.draft_token_ids
        plan = StepPlan(
            step_id=step, cached_requests=CachedRequestData(
                [computed[h] for h in handles], [0, 0]
            ), scheduled=list(handles), num_scheduled_tokens=[1 + len(d) for d in drafts],
            spec_token_ids=drafts, propose=True,
        )  # fmt: skip
    assert len(host_proposals) == 1  # the prefill's; every verify's drafts came on the device
    if draft_name == "target":
        assert accepted_total == 5 * 2 * K


def plan_of(step_id: int, runner: ModelRunner, handles: list[int], propose: bool,
            new: list[NewRequestData] = ()) -> StepPlan:  # fmt: skip
    """A step of one token for each of `handles` (in the batch) after its known tokens, then
    `new` requests' prompts past their prefix-cache hits; no drafts."""
    batch = runner.input_batch
    computed = [int(batch.num_tokens[batch.row_of[h]]) - 1 for h in handles]
    news = list(new)
    prompts = [len(r.token_ids) - r.num_computed_tokens for r in news]
    return StepPlan(
        step_id=step_id, new_requests=news,
        cached_requests=CachedRequestData(computed, [0] * len(handles)),
        scheduled=handles + [r.handle for r in news],
        num_scheduled_tokens=[1] * len(handles) + prompts,
        spec_token_ids=[[] for _ in handles + news] if propose else [], propose=propose,
    )  # fmt: skip


def test_the_draft_catches_up_after_steps_without_speculation(models: dict[str, Path]) -> None:
    """Steps that do not speculate (disable_by_batch_size) leave the draft's KV behind: a
    prefill and decodes, then a request that hits the prefix cache on blocks computed there.
    The next speculative step's proposals are still the draft's greedy continuation."""
    runner = make_runner(models["target"], models["draft"])
    draft = transformers.AutoModelForCausalLM.from_pretrained(models["draft"], dtype=torch.float32)
    prompt = random_prompts(400, [20], seed=4)[0]
    first = NewRequestData(10, list(prompt), len(prompt), GREEDY, 0, [0, 1, 2, 3], 0)
    result = runner.execute(plan_of(0, runner, [], False, [first]))
    for step in range(1, 5):  # plain decodes
        result = runner.execute(plan_of(step, runner, [10], False))
    assert not result.draft_token_ids and not result.num_sampled
    row = runner.input_batch.row_of[10]
    tokens = runner.input_batch.token_ids[row, : runner.input_batch.num_tokens[row]].tolist()
    # a second request with the first's first block, computed without the draft, speculates
    # while the first waits (it would catch that block up)
    hit = NewRequestData(11, list(prompt[:18]), 18, GREEDY, 1, [0, 4, 5, 6], 16)
    result = runner.execute(plan_of(5, runner, [], True, [hit]))
    second = list(prompt[:18]) + result.sampled_token_ids
    assert result.draft_token_ids == [greedy_continuation(draft, second, K)]
    result = runner.execute(plan_of(6, runner, [10], True))
    tokens += result.sampled_token_ids
    assert result.draft_token_ids == [greedy_continuation(draft, tokens, K)]
