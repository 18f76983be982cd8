"""Prompt logprobs and constrained decoding through the offline `LLM` (real actor processes):
prompt logprobs against transformers across prefill chunks and beside prefix-cache hits;
constrained requests beside speculated ones, through preemption; the worker's grammar masks
and matchers (a matcher rebuilt from a request's history equals one that followed it)."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import Future
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from pagedserve import LLM, SamplingParams, StructuredOutputsParams
from pagedserve.actors.chat import eos_token_ids
from pagedserve.actors.grammars import load_ll_tokenizer
from pagedserve.actors.messages import AddRequest, TokenLogprobs
from pagedserve.actors.scheduler.request import Request
from pagedserve.actors.worker import structured as structured_module
from pagedserve.actors.worker.structured import StructuredOutputs, apply_token_bitmask
from pagedserve.config import ASSETS_DIR, EngineConfig
from tests.engine_settings import NO_STANDBY
from tests.json_schemas import random_schema
from tests.tiny_models import load_hf_model, random_prompts, save_tiny_model

LOGPROB_ATOL = 1e-3
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 2}  # fmt: skip


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("prompt-logprobs"))


def test_prompt_logprobs_match_transformers_across_chunks_and_cache_hits(
    llama_path: Path,
) -> None:
    """Prompts of 1, 5 and 40 tokens with a 16-token step budget (the long one is prefilled
    in three chunks), run twice: the second run's blocks are cached, yet requests that want
    prompt logprobs compute every position again (they skip the prefix cache)."""
    prompts = random_prompts(400, [1, 5, 40], seed=2)
    wanted = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    with LLM(
        str(llama_path), max_num_batched_tokens=16, num_kv_blocks=64, supervision=NO_STANDBY,
        skip_tokenizer_init=True,  # token ids in and out: no tokenizer to load
    ) as llm:  # fmt: skip
        first = llm.generate([*prompts, prompts[2]], [wanted, wanted, wanted, plain])
        second = llm.generate([*prompts, prompts[2]], [wanted, wanted, wanted, plain])
    model = load_hf_model(llama_path)
    for run in (first, second):
        for prompt, output in zip(prompts, run):
            assert_prompt_logprobs(model, prompt, output.prompt_logprobs, k=3)
        assert run[3].prompt_logprobs is None
    assert second[2].num_cached_tokens == 0 and second[3].num_cached_tokens > 0
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]


def assert_prompt_logprobs(model, prompt: list[int], entries, k: int) -> None:
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        row, token = expected[p - 1], prompt[p]
        entry = entries[p]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=LOGPROB_ATOL)
        assert entry[token].rank == int((row >= row[token]).sum())
        top = row.topk(k)
        by_rank = {lp.rank: (token_id, lp.logprob) for token_id, lp in entry.items()}
        for rank, (token_id, value) in enumerate(zip(top.indices.tolist(), top.values), 1):
            assert by_rank[rank][0] == token_id
            assert by_rank[rank][1] == pytest.approx(value.item(), abs=LOGPROB_ATOL)


def test_constrained_requests_beside_speculation_and_preemption() -> None:
    """Ten constrained requests and two that the n-gram proposer speculates on, in a KV cache
    too small for all: constrained outputs validate (their matchers are rebuilt from their
    history when they resume), the others are speculated."""
    rng = random.Random(4)
    schemas = [random_schema(rng) for _ in range(10)]
    passage = "To be, or not to be, that is the question. " * 3
    constrained = [
        SamplingParams(max_tokens=300, seed=i, structured_outputs=StructuredOutputsParams(json=s))
        for i, s in enumerate(schemas)
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    with LLM(
        num_kv_blocks=24, enable_prefix_caching=False, speculative_config=NGRAM,
        supervision=NO_STANDBY,
    ) as llm:  # fmt: skip
        outputs = llm.generate(
            ["JULIET:"] * 10 + [passage] * 2, constrained + [greedy, greedy]
        )  # fmt: skip
        stats = llm.get_stats()
    for schema, output in zip(schemas, outputs):
        assert output.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(output.outputs[0].text), schema)
    assert stats.num_preemptions > 0
    assert stats.spec_num_draft_tokens > 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_structural_tags_constrain_what_follows_each_trigger() -> None:
    """vLLM's structural tags on the embedded model: the text is free until a trigger ("KING")
    appears, then the structure's begin, its grammar (here a Lark rule: three digits) and its
    end are forced; the same free text as without the constraint before the first trigger."""
    tag = {
        "structures": [{"begin": "KING JOHN:", "schema": 'start: " " /[0-9]{3}/', "end": "\n"}],
        "triggers": ["KING"],
    }
    prompt = "KING LEAR:\nKING LEAR:"
    plain = SamplingParams(temperature=0, max_tokens=60)
    tagged = SamplingParams(
        temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(structural_tag=tag)
    )
    with LLM(num_kv_blocks=256, supervision=NO_STANDBY) as llm:
        free, constrained = (o.outputs[0].text for o in llm.generate([prompt] * 2, [plain, tagged]))
    assert "KING" in free
    before = free.index("KING")
    assert constrained[:before] == free[:before]
    pieces = constrained.split("KING")[1:]  # what follows each trigger
    assert re.match(r" JOHN: [0-9]{3}\n", pieces[0]), constrained
    for piece in pieces[1:]:  # one that max_tokens cut short is checked as far as it goes
        assert re.match(r" JOHN: [0-9]{3}\n", piece) or len(piece) < len(" JOHN: 123\n")


def test_apply_token_bitmask_masks_exactly_the_disallowed_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 70, generator=gen)
    allowed = torch.rand(3, 70, generator=gen) < 0.3
    bits = torch.zeros(3, 96, dtype=torch.int64)
    bits[:, :70] = allowed.long()
    words = (bits.reshape(3, 3, 32) << torch.arange(32)).sum(-1)
    bitmask = words.to(torch.int64).where(words < 2**31, words - 2**32).to(torch.int32)
    masked = apply_token_bitmask(logits, bitmask)
    assert torch.equal(masked[allowed], logits[allowed])
    assert bool((masked[~allowed] == float("-inf")).all())
    with pytest.raises(ValueError):
        apply_token_bitmask(logits, bitmask[:, :2])


def test_a_matcher_rebuilt_from_history_masks_as_the_one_that_followed_it() -> None:
    """A request resumed after preemption arrives with its output so far: its new matcher
    (the compiled grammar fed that output) gives the same mask as the original."""
    config = EngineConfig(model=str(ASSETS_DIR / "tiny-shakespeare")).resolve()
    structured = StructuredOutputs(config, 4096, torch.device("cpu"))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = StructuredOutputsParams(json=schema)
    tokenizer = load_ll_tokenizer(config.tokenizer_path, 4096, [0])
    history = tokenizer.tokenize_str('{"a": 12')
    structured.add(0, params, [])
    assert not structured.accept(0, history)
    structured.add(1, params, history)
    logits = structured.apply(torch.zeros(2, 4096), np.array([0, 1]))
    assert torch.equal(logits[0], logits[1])
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert (
        tokenizer.tokenize_str("}")[0] in allowed and tokenizer.tokenize_str('"')[0] not in allowed
    )
    assert structured.accept(0, tokenizer.tokenize_str("}"))  # the grammar is complete
    structured.close()


def test_a_request_keeps_the_first_copy_of_its_prompt_logprobs_and_sends_them_once() -> None:
    """Chunks arrive in order; a request recomputed after preemption sends them again (kept
    once); the list goes out once, with the first output after the last chunk."""
    add = AddRequest(
        client=b"c", seq=0, prompt_token_ids=[5, 6, 7, 8], eos_token_ids=[0],
        sampling=SamplingParams(prompt_logprobs=0),
    )  # fmt: skip
    req = Request.from_add(add, handle=1, seed=0)

    def entries(*token_ids: int) -> list[TokenLogprobs]:
        return [TokenLogprobs(t, -float(t), 1, [], []) for t in token_ids]

    req.add_prompt_logprobs(1, entries(6))
    assert req.take_prompt_logprobs() is None  # not all known yet
    req.add_prompt_logprobs(1, entries(6, 7))  # recomputed from the start: 6 is held already
    req.add_prompt_logprobs(3, entries(8))
    taken = req.take_prompt_logprobs()
    assert taken is not None and [e and e.token_id for e in taken] == [None, 6, 7, 8]
    req.add_prompt_logprobs(1, entries(6, 7, 8))  # after another preemption: sent already
    assert req.take_prompt_logprobs() is None
    plain = Request.from_add(
        AddRequest(client=b"c", seq=1, prompt_token_ids=[5], eos_token_ids=[0],
                   sampling=SamplingParams()), handle=2, seed=0,
    )  # fmt: skip
    assert plain.take_prompt_logprobs() is None


def test_a_grammar_that_does_not_compile_in_time_stops_its_request(monkeypatch) -> None:
    """The wait for a compile has a deadline: past it the request's matcher is in its error
    state (only EOS may follow), so the request ends instead of the worker hanging."""
    config = EngineConfig(model=str(ASSETS_DIR / "tiny-shakespeare")).resolve()
    structured = StructuredOutputs(config, 4096, torch.device("cpu"))
    monkeypatch.setattr(structured_module, "GRAMMAR_COMPILE_TIMEOUT_S", 0.05)
    structured.add(0, StructuredOutputsParams(json_object=True), [])
    structured.compiling[0] = (Future(), [])  # a compile that never finishes
    logits = structured.apply(torch.zeros(1, 4096), np.array([0]))
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed == sorted(eos_token_ids(config.model_path, None))  # the model's EOS only
    assert structured.accept(0, [0])
    structured.close()
