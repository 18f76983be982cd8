"""Sampler: greedy, filters restrict the support, counter-based draws, penalties, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedserve.actors.messages import NewRequestData, SamplingParams
from pagedserve.actors.worker.input_batch import InputBatch
from pagedserve.actors.worker.sampler import (
    PenaltyState,
    Sampler,
    SamplingMetadata,
    apply_penalties,
)

VOCAB = 50
CPU = torch.device("cpu")


def make_batch(params: list[SamplingParams], prompts: list[list[int]] | None = None) -> InputBatch:
    batch = InputBatch(
        max_num_reqs=max(8, len(params)), max_model_len=64, block_size=16, device=CPU
    )
    for i, p in enumerate(params):
        prompt = prompts[i] if prompts else [1, 2, 3]
        seed = p.seed if p.seed is not None else 1000 + i  # the scheduler draws one per request
        batch.add_request(NewRequestData(i, prompt, len(prompt), p, seed, [i], 0))
    return batch


def metadata_at(batch: InputBatch, rows: np.ndarray, vocab: int, position: int | None = None):
    """Sampling metadata of `rows`, each sampling the token at `position` (default: the one
    after its known tokens)."""
    positions = batch.num_tokens[rows] if position is None else np.full(len(rows), position)
    return batch.sampling_metadata(rows, positions, vocab)


def sample(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[list[int], InputBatch]:
    batch = make_batch(params)
    metadata = metadata_at(batch, np.arange(len(params)), logits.shape[1])
    out = Sampler(use_triton=False)(logits, metadata)
    return out.token_ids.tolist(), batch


def peaked_logits(rows: int, probs: list[float]) -> torch.Tensor:
    """Rows of log(probs) padded with near-impossible tokens up to VOCAB."""
    logits = torch.full((rows, VOCAB), -30.0)
    logits[:, : len(probs)] = torch.tensor(probs).log()
    return logits


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    tokens, _ = sample(logits, [SamplingParams(temperature=0.0)] * 6)
    assert tokens == logits.argmax(-1).tolist()


def test_mixed_greedy_and_random_rows() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2
    tokens, _ = sample(logits, params)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


PROBS = [0.45, 0.3, 0.15, 0.06, 0.04]


@pytest.mark.parametrize(
    "params,support",
    [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.7), {0, 1}),  # 0.45 + 0.3 >= 0.7: the nucleus is two tokens
        (SamplingParams(top_p=0.8), {0, 1, 2}),
        (SamplingParams(min_p=0.3), {0, 1, 2}),  # threshold 0.135
        (SamplingParams(min_p=0.5), {0, 1}),
        (SamplingParams(top_k=3, top_p=0.6), {0, 1}),  # top-p after top-k renormalises
        (SamplingParams(), {0, 1, 2, 3, 4}),
    ],
)
def test_filters_restrict_support(params: SamplingParams, support: set[int]) -> None:
    rows = 3000
    tokens, _ = sample(peaked_logits(rows, PROBS), [params] * rows)
    assert set(tokens) == support


def test_top_k_rows_differ_within_a_batch() -> None:
    params = [SamplingParams(top_k=1), SamplingParams(), SamplingParams(top_k=2)] * 500
    tokens, _ = sample(peaked_logits(len(params), PROBS), params)
    assert set(tokens[0::3]) == {0}
    assert set(tokens[1::3]) == {0, 1, 2, 3, 4}
    assert set(tokens[2::3]) == {0, 1}


def test_sampling_frequencies_follow_probabilities() -> None:
    rows = 20000
    tokens, _ = sample(peaked_logits(rows, PROBS), [SamplingParams(temperature=1.0)] * rows)
    frequencies = np.bincount(tokens, minlength=VOCAB)[: len(PROBS)] / rows
    np.testing.assert_allclose(frequencies, PROBS, atol=0.015)


def test_a_draw_depends_only_on_the_request_seed_and_position() -> None:
    """Counter-based draws: the same (seed, position) gives the same token alone or in any
    batch, at any step; another position or seed gives another draw."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2))
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def run(params: list[SamplingParams], row: int, positions: range) -> list[int]:
        batch, sampler = make_batch(params), Sampler(use_triton=False)
        rows = np.arange(len(params))
        steps = []
        for position in positions:
            metadata = metadata_at(batch, rows, VOCAB, position)
            steps.append(sampler(logits.expand(len(params), -1), metadata).token_ids[row].item())
        return steps

    alone = run([seeded], 0, range(3, 23))
    others = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0, seed=5)]
    crowded = run(others + [seeded] + others, 2, range(3, 23))
    assert alone == crowded
    assert run([seeded], 0, range(12, 23)) == alone[9:]  # resumed at position 12: the same
    assert len(set(alone)) > 1  # it does sample
    assert run([SamplingParams(temperature=1.0, seed=4321)], 0, range(3, 23)) != alone


def test_triton_and_torch_samplers_draw_the_same_tokens() -> None:
    """The Triton kernels (under the interpreter here) and the torch path share the noise."""
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    params = [
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=7),
        SamplingParams(temperature=0.6, seed=77),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=2.0, top_k=3),
    ]
    batch = make_batch(params)
    metadata = metadata_at(batch, np.arange(len(params)), VOCAB, position=40)
    torch_ids = Sampler(use_triton=False)(logits, metadata).token_ids
    triton_ids = Sampler(use_triton=True)(logits, metadata).token_ids
    assert torch_ids.tolist() == triton_ids.tolist()


def test_penalties_formula() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, -1.0]])
    counts = torch.tensor([[2.0, 1.0, 0.0, 0.0, 0.0]])
    prompt = torch.tensor([[False, False, True, False, False]])
    one = torch.ones(1)
    state = PenaltyState(0.5 * one, 0.25 * one, 2.0 * one, counts, prompt)
    expected = [2.0 / 2 - 0.25 * 2 - 0.5, -2.0 * 2 - 0.25 - 0.5, 1.0 / 2, 0.5, -1.0]
    assert apply_penalties(logits, state).tolist() == [expected]


def test_penalty_histograms_split_prompt_and_output() -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0)
    batch = make_batch([params, SamplingParams()], prompts=[[3, 4, 3], [5]])
    batch.append_sampled(np.array([0, 1]), np.array([7, 8]))
    batch.append_sampled(np.array([0]), np.array([7]))
    metadata = metadata_at(batch, np.array([0, 1]), 10)
    penalties = metadata.penalties
    assert penalties is not None
    assert penalties.output_counts[0].tolist() == [0, 0, 0, 0, 0, 0, 0, 2, 0, 0]
    assert penalties.output_counts[1].tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 1, 0]
    assert penalties.prompt_mask[0].nonzero().squeeze(1).tolist() == [3, 4]
    assert penalties.repetition.tolist() == [2.0, 1.0] and penalties.frequency.tolist() == [1, 0]


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0] + [-5.0] * (VOCAB - 3)])
    params = SamplingParams(temperature=0.0, presence_penalty=0.5)
    batch = make_batch([params], prompts=[[1]])
    batch.append_sampled(np.array([0]), np.array([0]))  # token 0 was already generated
    metadata = metadata_at(batch, np.array([0]), VOCAB)
    assert Sampler(use_triton=False)(logits, metadata).token_ids.tolist() == [1]


def test_logprobs_from_raw_logits_with_ranks() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0] + [-10.0] * (VOCAB - 5)] * 3)
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=2.0),
        SamplingParams(temperature=0.5, top_k=1, logprobs=0),
        SamplingParams(temperature=0.0),
    ]
    batch = make_batch(params, prompts=[[1], [1], [1]])
    metadata = metadata_at(batch, np.arange(3), VOCAB)
    out = Sampler(use_triton=False)(logits, metadata)
    raw = torch.log_softmax(logits[0], -1)
    assert out.logprobs is not None and out.logprobs[2] is None
    first, second = out.logprobs[0], out.logprobs[1]
    assert first is not None and second is not None
    assert first.token_id == 2 and first.rank == 2  # the penalty moved greedy off token 1
    assert math.isclose(first.logprob, raw[2].item(), rel_tol=1e-6)  # raw, not penalised
    assert first.top_token_ids == [1, 2, 0]
    np.testing.assert_allclose(first.top_logprobs, raw[[1, 2, 0]].numpy(), rtol=1e-6)
    assert (second.token_id, second.rank, second.top_token_ids) == (1, 1, [])


def test_metadata_skips_unused_filters() -> None:
    batch = make_batch([SamplingParams(temperature=0.8), SamplingParams(temperature=0.0)])
    metadata = metadata_at(batch, np.arange(2), VOCAB)
    assert isinstance(metadata, SamplingMetadata)
    assert metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
    assert metadata.penalties is None and not metadata.wants_logprobs


def test_a_resumed_request_counts_its_earlier_output_as_output() -> None:
    """After preemption a request comes back whole: penalties still see its output."""
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0, repetition_penalty=2.0)
    batch = InputBatch(max_num_reqs=4, max_model_len=64, block_size=16, device=CPU)
    batch.add_request(NewRequestData(9, [3, 4, 7, 7, 8], 2, params, 5, [0], 0))
    penalties = metadata_at(batch, np.array([0]), 10).penalties
    assert penalties is not None
    assert penalties.output_counts[0].tolist() == [0, 0, 0, 0, 0, 0, 0, 2, 1, 0]
    assert penalties.prompt_mask[0].nonzero().squeeze(1).tolist() == [3, 4]


def test_a_handle_already_in_the_batch_is_refused() -> None:
    batch = make_batch([SamplingParams()])
    with pytest.raises(ValueError, match="already in the persistent batch"):
        batch.add_request(NewRequestData(0, [1, 2], 2, SamplingParams(), 1, [3], 0))


def test_logit_bias_is_added_before_sampling_and_logprobs_stay_raw() -> None:
    """vLLM's logit_bias: each biased token's logit gets its bias before penalties and
    sampling (greedy and seeded rows alike, only the rows that ask), while the returned
    logprobs are those of the raw logits."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
    favourite, banned = int(logits[0].argmin()), int(logits[1].argmax())
    params = [
        SamplingParams(temperature=0.0, logit_bias={favourite: 100.0}, logprobs=1),
        SamplingParams(temperature=1.0, seed=9, logit_bias={banned: -100.0}),
        SamplingParams(temperature=0.0),
    ]
    batch = make_batch(params)
    assert not batch.all_plain_greedy(np.arange(3)) and batch.all_plain_greedy(np.array([2]))
    draws = set()
    for position in range(40):  # the seeded row draws anew at every position
        metadata = metadata_at(batch, np.arange(3), VOCAB, position)
        out = Sampler(use_triton=False)(logits, metadata)
        tokens = out.token_ids.tolist()
        assert tokens[0] == favourite and tokens[2] == int(logits[2].argmax())
        draws.add(tokens[1])
    assert banned not in draws and len(draws) > 5
    raw = torch.log_softmax(logits[0], dim=-1)[favourite].item()
    assert out.logprobs[0].logprob == pytest.approx(raw, abs=1e-5)  # type: ignore[index]


def test_allowed_token_ids_restrict_greedy_and_seeded_rows_and_logprobs_stay_raw() -> None:
    """vLLM's allowed_token_ids: a row samples only among its tokens (greedy picks the best of
    them, a seeded row draws only them), other rows are untouched, logprobs stay raw."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5))
    worst = logits[0].argsort()[:2].tolist()  # the two least likely tokens of row 0
    allowed = [3, 11, 17, 29]
    params = [
        SamplingParams(temperature=0.0, allowed_token_ids=worst, logprobs=0),
        SamplingParams(temperature=1.0, seed=2, allowed_token_ids=allowed),
        SamplingParams(temperature=0.0),
    ]
    batch = make_batch(params)
    assert not batch.all_plain_greedy(np.arange(2)) and batch.all_plain_greedy(np.array([2]))
    draws = set()
    for position in range(60):
        out = Sampler(use_triton=False)(logits, metadata_at(batch, np.arange(3), VOCAB, position))
        tokens = out.token_ids.tolist()
        assert tokens[0] == max(worst, key=lambda t: logits[0, t].item())
        assert tokens[2] == int(logits[2].argmax())
        draws.add(tokens[1])
    assert draws == set(allowed)
    raw = torch.log_softmax(logits[0], dim=-1)[tokens[0]].item()
    assert out.logprobs[0].logprob == pytest.approx(raw, abs=1e-5)  # type: ignore[index]
    with pytest.raises(ValueError, match="must not be empty"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="token ids"):
        SamplingParams(allowed_token_ids=[-1])


def test_logit_bias_keys_must_be_token_ids() -> None:
    with pytest.raises(ValueError, match="token ids"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match="finite"):
        SamplingParams(logit_bias={3: math.inf})
