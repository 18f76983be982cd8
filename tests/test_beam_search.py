"""Beam search (vLLM's `LLM.beam_search`, `BeamSearchParams`): the search itself against an
exhaustive ranking, and the whole engine against the same search written plainly over
transformers' logits."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.api.beam_search import BeamSearch, BeamSearchParams, chosen_logprobs
from pagedserve.outputs import Logprob
from tests.engine_settings import NO_STANDBY
from tests.tiny_models import hf_beam_search, hf_greedy, load_hf_model, save_tiny_model

VOCAB = 5
EOS = 4


def toy_logprobs(tokens: list[int]) -> list[float]:
    """A fixed next-token distribution over VOCAB tokens for each prefix (seeded by it)."""
    rng = random.Random(str(tokens))
    weights = [0.01 + rng.random() for _ in range(VOCAB)]
    total = sum(weights)
    return [math.log(w / total) for w in weights]


def toy_step(tokens: list[int], top: int) -> dict[int, Logprob]:
    """What the engine gives a step: the `top` most likely tokens with their ranks."""
    ranked = sorted(enumerate(toy_logprobs(tokens)), key=lambda item: -item[1])[:top]
    return {token: Logprob(logprob, rank) for rank, (token, logprob) in enumerate(ranked, 1)}


def run_toy(params: BeamSearchParams, prompt: list[int], max_model_len: int = 100) -> BeamSearch:
    search = BeamSearch(params, [EOS], max_model_len)
    search.start(prompt, toy_step(prompt, 2 * params.beam_width))
    while not search.done:
        search.advance([toy_step(b.tokens, 2 * params.beam_width) for b in search.live])
    return search


def exhaustive(prompt: list[int], max_tokens: int, length_penalty: float) -> list[tuple]:
    """Every output a search of max_tokens steps can end with (an EOS ends one early), as
    (score, tokens, cumulative logprob), best first."""
    finals = []
    for length in range(1, max_tokens + 1):
        for output in itertools.product(range(VOCAB), repeat=length):
            if EOS in output[:-1] or (length < max_tokens and output[-1] != EOS):
                continue
            tokens, cum = list(prompt), 0.0
            for token in output:
                cum += toy_logprobs(tokens)[token]
                tokens = tokens + [token]
            n = len(tokens) - (tokens[-1] == EOS)
            finals.append((cum / n**length_penalty, tokens, cum))
    return sorted(finals, key=lambda f: -f[0])


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_a_beam_wider_than_the_tree_finds_the_exhaustive_ranking(length_penalty: float) -> None:
    """With room for every prefix (5 + 25 live beams), beam search ranks every possible output
    as enumerating them all does: scores, cumulative logprobs, EOS and length endings."""
    prompt = [1, 2, 3]
    params = BeamSearchParams(beam_width=30, max_tokens=3, length_penalty=length_penalty)
    search = run_toy(params, prompt)
    expected = exhaustive(prompt, 3, length_penalty)[:30]
    got = search.best()
    assert [b.tokens for b in got] == [tokens for _, tokens, _ in expected]
    assert [b.cum_logprob for b in got] == pytest.approx([cum for _, _, cum in expected])
    for beam in got:
        assert beam.finish_reason == ("stop" if beam.tokens[-1] == EOS else "length")
        assert len(beam.logprobs) == len(search.output_ids(beam))


def test_eos_endings_max_model_len_and_the_texts_tokens() -> None:
    prompt = [0, 1]
    search = run_toy(BeamSearchParams(beam_width=2, max_tokens=50), prompt, max_model_len=6)
    for beam in search.best():
        assert len(beam.tokens) <= 6
        ids = search.output_ids(beam)
        assert ids == beam.tokens[2:]
        if beam.finish_reason == "stop":
            assert search.text_ids(beam) == ids[:-1]  # the EOS is not in the text
        else:
            assert len(beam.tokens) == 6 and search.text_ids(beam) == ids
    kept = run_toy(BeamSearchParams(2, 50, include_stop_str_in_output=True), prompt, 6)
    assert all(kept.text_ids(b) == kept.output_ids(b) for b in kept.best())
    ignoring = run_toy(BeamSearchParams(2, 4, ignore_eos=True), prompt)
    assert all(b.finish_reason == "length" and len(b.tokens) == 6 for b in ignoring.best())


def test_chosen_logprobs_give_each_tokens_rank_and_its_steps_top() -> None:
    search = run_toy(BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True), [1])
    beam = search.best()[1]
    ids = search.output_ids(beam)
    for token_id, entry, step in zip(ids, chosen_logprobs(beam, ids, 2), beam.logprobs):
        assert (entry.token_id, entry.logprob, entry.rank) == (
            token_id,
            step[token_id].logprob,
            step[token_id].rank,
        )
        assert entry.top_token_ids == [t for t, lp in step.items() if lp.rank in (1, 2)]
        assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)


@pytest.mark.parametrize(
    "fields",
    [dict(beam_width=0, max_tokens=4), dict(beam_width=2, max_tokens=0),
     dict(beam_width=2, max_tokens=4, temperature=-1.0),
     dict(beam_width=2, max_tokens=4, length_penalty=math.inf),
     dict(beam_width=2, max_tokens=4, length_penalty=1e30)],
)  # fmt: skip
def test_bad_beam_search_params_are_a_value_error(fields: dict) -> None:
    with pytest.raises(ValueError):
        BeamSearchParams(**fields)


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory) -> tuple[Path, int]:
    """A tiny Llama whose generation config names as EOS the token greedy decoding gives
    second after the first test prompt, so that the searches meet it."""
    path = save_tiny_model("llama", tmp_path_factory.mktemp("beams"))
    greedy, _ = hf_greedy(load_hf_model(path), PROMPTS[0], 2)
    config_file = path / "generation_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "eos_token_id": greedy[1]}))
    return path, greedy[1]


PROMPTS = [[5, 17, 99, 3, 42], [7] * 20, list(range(30, 60))]


def test_beam_search_through_the_engine_follows_transformers(eos_model) -> None:
    """LLM.beam_search on real processes gives the beams of the plain search over
    transformers' logits: tokens, EOS endings and cumulative logprobs; a beam of width 1 is
    greedy decoding; every KV block is free afterwards."""
    path, eos = eos_model
    model = load_hf_model(path)
    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5)
    with LLM(str(path), num_kv_blocks=128, supervision=NO_STANDBY) as llm:
        outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
        text_prompt = llm.beam_search("To be, or not", BeamSearchParams(2, 4))[0]
        one = llm.beam_search(PROMPTS[1:], BeamSearchParams(1, 8, ignore_eos=True))[0]
        greedy = llm.generate(
            PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        )[0]
        stats = llm.get_stats()
        tokenizer = llm._tokenizer
    ended = 0
    for prompt, output in zip(PROMPTS, outputs):
        expected = hf_beam_search(model, prompt, 3, 6, {eos}, length_penalty=0.5)
        assert [b.tokens for b in output.sequences] == [tokens for tokens, _ in expected]
        got = [b.cum_logprob for b in output.sequences]
        assert got == pytest.approx([cum for _, cum in expected], abs=1e-3)
        for beam in output.sequences:
            output_ids = beam.tokens[len(prompt) :]
            ended += beam.finish_reason == "stop"
            text_ids = output_ids[:-1] if beam.finish_reason == "stop" else output_ids
            assert beam.text == tokenizer.decode(text_ids)
    assert ended > 0  # the EOS was met
    assert len(text_prompt.sequences) == 2 and all(b.text for b in text_prompt.sequences)
    assert one.sequences[0].tokens[len(PROMPTS[1]) :] == greedy.outputs[0].token_ids
    assert stats.num_free_blocks == stats.num_total_blocks
