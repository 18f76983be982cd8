"""Speculative decoding through the whole engine: n-gram and draft-model proposers.

Verification accepts a draft exactly when it equals the token the target samples at its
position (draws are counter-based), so the output with speculation must be the output without:
identical for greedy and seeded sampling, whatever the drafts, with preemption and prefix-cache
hits; and sampled output must follow the target's distribution.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.api.client import Client
from tests.engine_settings import NO_STANDBY
from tests.tiny_models import random_prompts, save_tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """Targets of two architectures and, per architecture, a different (smaller) draft."""
    paths = {}
    for arch in ("llama", "qwen3"):
        paths[arch] = save_tiny_model(arch, tmp_path_factory.mktemp(arch))
        draft_dir = tmp_path_factory.mktemp(f"{arch}-draft")
        paths[f"{arch}-draft"] = save_tiny_model(arch, draft_dir, seed=1, hidden_size=32)
    return paths


def copy_heavy_prompts(vocab: int) -> list[list[int]]:
    """Random prompts, and prompts that repeat a passage (n-gram lookups find matches)."""
    passage = random_prompts(vocab, [12], seed=9)[0]
    return random_prompts(vocab, [3, 17, 30], seed=8) + [passage * 3, passage * 2 + passage[:5]]


def token_ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = copy_heavy_prompts(400)


def run_on(llm: LLM) -> tuple[list[list[int]], object]:
    """PROMPTS, then the last one again (a prefix-cache hit); token ids of the first run."""
    outputs = llm.generate(PROMPTS, GREEDY)
    again = llm.generate(PROMPTS[-1:], GREEDY)
    stats = llm.get_stats()
    assert token_ids(again) == token_ids(outputs[-1:])
    assert stats.num_free_blocks == stats.num_total_blocks  # every KV block free afterwards
    return token_ids(outputs), stats


def run(path: Path | str, **engine) -> tuple[list[list[int]], object]:
    with LLM(str(path), skip_tokenizer_init=True, supervision=NO_STANDBY, **engine) as llm:
        return run_on(llm)


@pytest.fixture(scope="module")
def plain_llama(tiny: dict[str, Path]):
    """The Llama target's engine without speculation: the greedy reference of `plain` and of
    the switching test (one engine start for both)."""
    with LLM(
        str(tiny["llama"]), skip_tokenizer_init=True, num_kv_blocks=256, supervision=NO_STANDBY
    ) as llm:
        yield llm


@pytest.fixture(scope="module")
def plain(tiny: dict[str, Path], plain_llama: LLM) -> dict[str, list[list[int]]]:
    """The greedy outputs without speculation, per architecture."""
    return {"llama": run_on(plain_llama)[0], "qwen3": run(tiny["qwen3"], num_kv_blocks=256)[0]}


@pytest.mark.parametrize(
    "arch,proposer",
    [("llama", "ngram"), ("llama", "draft"), ("qwen3", "ngram"), ("qwen3", "self-draft"),
     ("llama", "ngram-rounds"), ("qwen3", "self-draft-rounds")],
)  # fmt: skip
def test_greedy_output_is_identical_with_speculation(
    arch: str, proposer: str, tiny: dict[str, Path], plain: dict[str, list[list[int]]]
) -> None:
    target = tiny[arch]
    spec = {
        "ngram": NGRAM,
        "draft": {"model": str(tiny[f"{arch}-draft"]), "num_speculative_tokens": 3},
        "self-draft": {"model": str(target), "num_speculative_tokens": 3},
        # several verifies per step (the worker verifies its own proposals again)
        "ngram-rounds": NGRAM | {"num_rounds": 3},
        "self-draft-rounds": {"model": str(target), "num_speculative_tokens": 2, "num_rounds": 3},
    }[proposer]
    # 9 blocks of 16 tokens cannot hold the 5 requests at once: preemption
    outputs, stats = run(target, num_kv_blocks=9, speculative_config=spec)
    assert outputs == plain[arch]
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_num_draft_tokens > 0
    if proposer.startswith("self-draft"):  # the target drafting for itself: all accepted
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    if proposer == "self-draft-rounds":  # more verifies (each of drafts) than steps
        assert stats.spec_num_drafts > stats.num_steps, (stats.spec_num_drafts, stats.num_steps)
    if proposer.startswith("ngram"):
        assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


LATE_ARRIVALS = PROMPTS[3:] + PROMPTS[:3]  # a copy-heavy prompt first: n-grams match


def generate_with_late_arrivals(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    """The first prompt streams alone (speculating); once its first tokens are out, the
    others arrive while its verify step is in flight."""
    first: list[int] = []
    with Client(llm.supervisor.addresses.engine_address) as client:
        stream = client.generate(LATE_ARRIVALS[0], params[0])
        while len(first) < 8:  # past the prefill: verify steps with drafts run
            first += next(stream).token_ids
        rest = token_ids(llm.generate(LATE_ARRIVALS[1:], params[1:], use_tqdm=False))
        for delta in stream:
            first += delta.token_ids
    return [first, *rest]


def test_speculation_switching_off_and_on_with_the_batch_size_keeps_greedy_output(
    tiny: dict[str, Path], plain_llama: LLM
) -> None:
    """disable_by_batch_size: speculation stops when requests arrive while one speculates
    (its verify step in flight) and starts again as they finish (max_tokens differ); the
    output is the plain engine's."""
    spec = {"model": str(tiny["llama-draft"]), "num_speculative_tokens": 3,
            "disable_by_batch_size": 2}  # fmt: skip
    params = [SamplingParams(temperature=0.0, max_tokens=60 - 9 * i, ignore_eos=True)
              for i in range(len(PROMPTS))]  # fmt: skip
    plain = generate_with_late_arrivals(plain_llama, params)
    with LLM(
        str(tiny["llama"]),
        skip_tokenizer_init=True,
        num_kv_blocks=256,
        supervision=NO_STANDBY,
        speculative_config=spec,
    ) as llm:
        switching = generate_with_late_arrivals(llm, params)
        stats = llm.get_stats()
    assert switching == plain
    assert stats.spec_num_draft_tokens > 0


SHAKESPEARE = [
    "ROMEO:",
    "To be, or not to be, that is the question:\nTo be, or not to be, that is",
    "KING LEAR:\nKING LEAR:",
]


PENALISED = [
    SamplingParams(temperature=0.0, max_tokens=40, logprobs=2, stop=["\n\n"],
                   logit_bias={5: 3.0, 6: -2.0}, bad_words=["am", "my lord"]),
    SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=40, n=2,
                   presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.3,
                   bad_words=["I am", "my"]),
    SamplingParams(temperature=0.7, top_k=40, seed=6, max_tokens=40, logprobs=0,
                   logit_bias={10: -4.0}, allowed_token_ids=list(range(2, 1500, 2))),
]  # fmt: skip


@pytest.fixture(scope="module")
def plain_penalised() -> list:
    """The plain embedded engine's outputs of SHAKESPEARE under PENALISED (seeded: the same
    for every speculative run that compares with them)."""
    with LLM(num_kv_blocks=256, supervision=NO_STANDBY) as plain:
        return plain.generate(SHAKESPEARE, PENALISED)


@pytest.mark.parametrize(
    "spec", [NGRAM, {"model": "pagedserve/tiny-shakespeare", "num_speculative_tokens": 3}],
    ids=["ngram", "draft"],
)  # fmt: skip
def test_sampling_penalties_logprobs_stops_and_n_match_the_plain_engine(
    spec: dict, plain_penalised: list
) -> None:
    """Seeded sampling with penalties, logit biases, allowed tokens, bad words, logprobs, stop
    strings and n > 1 on the embedded model: the same tokens, text, logprobs and finishes with
    and without speculation."""
    expected = plain_penalised
    with LLM(num_kv_blocks=256, speculative_config=spec, supervision=NO_STANDBY) as speculative:
        outputs = speculative.generate(SHAKESPEARE, PENALISED)
        stats = speculative.get_stats()
    assert stats.spec_num_drafts > 0
    if "model" in spec:  # the embedded model drafting for itself: drafts are often accepted
        assert stats.spec_num_accepted_tokens > 0
    for got, want in zip(outputs, expected):
        for a, b in zip(got.outputs, want.outputs, strict=True):
            assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
                b.token_ids, b.text, b.finish_reason, b.stop_reason,
            )  # fmt: skip
            if b.logprobs is not None:
                assert a.logprobs is not None
                for x, y in zip(a.logprobs, b.logprobs, strict=True):
                    assert x.keys() == y.keys()
                    assert all(math.isclose(x[t].logprob, y[t].logprob, abs_tol=1e-4) for t in x)


VOCAB = 8


def save_small_vocab_model(path: Path, seed: int, hidden: int) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        initializer_range=0.3, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def test_sampled_output_follows_the_target_distribution(tmp_path: Path) -> None:
    """Chi-square over (first, second) sampled tokens of many seeded requests: the second
    token comes from a verify step (a draft of a deliberately different model)."""
    target = save_small_vocab_model(tmp_path / "target", seed=0, hidden=32)
    draft = save_small_vocab_model(tmp_path / "draft", seed=1, hidden=16)
    prompt = [1, 5, 2]
    num = 3000
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True)
              for s in range(num)]  # fmt: skip
    spec = {"model": str(draft), "num_speculative_tokens": 2}
    with LLM(str(target), skip_tokenizer_init=True, num_kv_blocks=2048, max_num_seqs=256,
             speculative_config=spec, supervision=NO_STANDBY) as llm:  # fmt: skip
        outputs = llm.generate([prompt] * num, params)
        stats = llm.get_stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
    counts = Counter(tuple(o.outputs[0].token_ids[:2]) for o in outputs)
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.inference_mode():
        first = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        second = {t: model(torch.tensor([prompt + [t]])).logits[0, -1].softmax(-1)
                  for t in range(VOCAB)}  # fmt: skip
    expected = {(a, b): num * first[a].item() * second[a][b].item()
                for a, b in itertools.product(range(VOCAB), repeat=2)}  # fmt: skip
    big = [cell for cell, e in expected.items() if e >= 5]
    small = [cell for cell in expected if cell not in big]  # pooled into one cell
    observed = [counts[c] for c in big] + [sum(counts[c] for c in small)]
    wanted = [expected[c] for c in big] + [sum(expected[c] for c in small)]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, wanted) if e > 0)
    dof = len(observed) - 1
    assert chi2 < dof + 4 * math.sqrt(2 * dof), (chi2, dof)  # ~ p > 1e-4


@pytest.mark.parametrize(
    "spec,message",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "unknown speculative method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "at least 1"),
        ({"num_speculative_tokens": 2, "mystery": 1}, "unknown field"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a draft"),
    ],
)
def test_bad_speculative_configs_fail_at_start(spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(speculative_config=spec)


def test_a_draft_with_another_vocabulary_fails_at_start(tiny: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        LLM(speculative_config={"model": str(tiny["llama"]), "num_speculative_tokens": 2})


def test_bench_and_metrics_report_speculative_decoding() -> None:
    """`pagedserve bench` prints the drafts' counts and rates; `/metrics` exports them."""
    import json

    import httpx

    from pagedserve.actors.supervisor import Supervisor
    from pagedserve.config import EngineConfig, ServerConfig
    from tests.test_cli import run_json
    from tests.test_openai_server import free_port

    spec = {"model": "pagedserve/tiny-shakespeare", "num_speculative_tokens": 2}
    rows = run_json(
        ["bench", "throughput", "--num-prompts", "4", "--input-len", "8", "16", "--output-len",
         "8", "16", "--backend", "pagedserve", "--speculative-config", json.dumps(spec)]
    )  # fmt: skip
    report = rows[0]["spec_decode"]
    assert report["num_draft_tokens"] > 0 and 0 <= report["acceptance_rate"] <= 1
    assert report["mean_accepted_length"] >= 1
    port = free_port()
    config = EngineConfig(
        server=ServerConfig(port=port), speculative_config=spec, supervision=NO_STANDBY
    )
    supervisor = Supervisor(config)
    supervisor.start(extra_actors=("api-server",))
    try:
        base = f"http://127.0.0.1:{port}"
        body = {"prompt": "ROMEO:", "max_tokens": 16, "temperature": 0}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
    finally:
        supervisor.stop()
    drafted = re.search(r"^pagedserve:spec_decode_num_draft_tokens (\S+)$", metrics, re.M)
    assert drafted is not None and float(drafted.group(1)) > 0
    assert "pagedserve:spec_decode_acceptance_rate" in metrics


SPEC_COUNTERS = ("num_generation_tokens", "spec_num_drafts", "spec_num_draft_tokens",
                 "spec_num_accepted_tokens", "spec_num_emitted_tokens")  # fmt: skip


def counted(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list[int], dict]:
    """One request's tokens, and what the engine's counters rose by while it ran."""
    before = llm.get_stats()
    [output] = llm.generate([prompt], params)
    after = llm.get_stats()
    return output.outputs[0].token_ids, {
        name: getattr(after, name) - getattr(before, name) for name in SPEC_COUNTERS
    }


def test_speculation_counters_cover_the_tokens_delivered(tiny: dict[str, Path]) -> None:
    """With rounds, one step verifies the worker's own proposals again: the counters must
    count the tokens the request got, not those verified past its max_tokens or its stop
    token. The target drafts for itself (every draft accepted), so every token but the
    prefill's comes from a verify."""
    spec = {"model": str(tiny["llama"]), "num_speculative_tokens": 2, "num_rounds": 3}
    prompt = PROMPTS[0]
    with LLM(str(tiny["llama"]), skip_tokenizer_init=True, num_kv_blocks=256,
             speculative_config=spec, supervision=NO_STANDBY) as llm:  # fmt: skip
        free_run, _ = counted(llm, prompt, SamplingParams(temperature=0.0, max_tokens=30,
                                                          ignore_eos=True))  # fmt: skip
        # a stop token first seen early: the step that emits it verified 9 tokens
        cut = next(i for i in range(1, 8) if free_run[i] not in free_run[:i])
        cases = {
            # after the prefill's token: rounds of 2 + 1, 2 + 1 and (cut to the room) 1 + 1
            "max_tokens": SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
            "stop token": SamplingParams(
                temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[free_run[cut]]
            ),
        }
        for name, params in cases.items():
            tokens, rose = counted(llm, prompt, params)
            assert len(tokens) == (9 if name == "max_tokens" else cut + 1), name
            assert rose["num_generation_tokens"] == len(tokens), name
            assert rose["spec_num_emitted_tokens"] == len(tokens) - 1, (name, rose)
            assert rose["spec_num_accepted_tokens"] == rose["spec_num_draft_tokens"], rose
            emitted_bound = rose["spec_num_accepted_tokens"] + rose["spec_num_drafts"]
            assert rose["spec_num_emitted_tokens"] <= emitted_bound, rose
