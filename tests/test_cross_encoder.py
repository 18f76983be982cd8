"""Sequence classifiers as cross-encoders (vLLM's score and rerank APIs for a reranker): a pair
is one sequence through the score head, and its score is the sigmoid of the head's one logit.
Two texts are encoded as the tokenizer encodes a text pair (vLLM's default for a sequence
classifier), two token-id lists are joined; `LLM.score`, `/score` and `/rerank` give
transformers' numbers, 1 -> N and N -> N. A causal LM served as a classifier through vLLM's
hf_overrides (`classifier_from_token`, Qwen3-Reranker's `is_original_qwen3_reranker`) scores
sigmoid(logit_yes - logit_no) of the causal LM at the last token of the two texts joined
(with tokens of the tiny vocabulary for yes and no).
Bad inputs are 400s (ValueErrors offline)."""

from __future__ import annotations

from pathlib import Path

import httpx2 as httpx
import numpy as np
import pytest
import torch
import transformers

from pagedserve import LLM
from pagedserve.actors.messages import GenerateRequest, PoolingParams
from pagedserve.actors.pooling_params import pooling_sampling
from pagedserve.actors.tokenizer import PromptEncoder
from pagedserve.config import EngineConfig, ServerConfig
from tests.engine_settings import NO_STANDBY
from tests.test_openai_server import free_port, running_server
from tests.tiny_models import random_prompts, save_tiny_model

ATOL = 1e-5  # float32 on both sides
MAX_MODEL_LEN = 128
ENGINE = {"max_model_len": MAX_MODEL_LEN, "num_kv_blocks": 64, "supervision": NO_STANDBY}
QUERY = "To be, or not to be"
DOCUMENTS = ["that is the question", "To be, or not", "Whether tis nobler", "to be"]
TOKENS = ["no", "the"]  # Qwen3-Reranker's are no and yes: the tiny vocabulary has no "yes"
RERANKER_OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": TOKENS,
    "is_original_qwen3_reranker": True,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cross_encoders")
    return {
        "reranker": save_tiny_model("llama", root / "reranker", num_labels=1),
        "qwen3": save_tiny_model("qwen3", root / "qwen3", seed=2),
        "tied": save_tiny_model("llama", root / "tied", seed=3, tie_word_embeddings=True),
    }


@pytest.fixture(scope="module")
def tokenizer(models) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(models["reranker"])


@pytest.fixture(scope="module")
def hf_reranker(models) -> transformers.PreTrainedModel:
    return transformers.AutoModelForSequenceClassification.from_pretrained(
        models["reranker"], dtype=torch.float32
    )


@pytest.fixture(scope="module")
def reranker(models):
    with LLM(str(models["reranker"]), **ENGINE) as llm:
        yield llm


def sigmoid(logit: float) -> float:
    return 1.0 / (1.0 + float(np.exp(-logit)))


def hf_score(model: transformers.PreTrainedModel, ids: list[int]) -> float:
    """transformers' score of a pair's sequence: the sigmoid of the classifier's one logit."""
    with torch.inference_mode():
        return sigmoid(model(torch.tensor([ids])).logits[0, 0].item())


def pair_ids(tokenizer: transformers.PreTrainedTokenizerBase, text: str, pair: str) -> list[int]:
    """The sequence of a text pair as vLLM makes it for a sequence classifier."""
    return tokenizer(text=text, text_pair=pair)["input_ids"]


def hf_yes_no_score(
    model: transformers.PreTrainedModel, ids: list[int], token_ids: list[int]
) -> float:
    """The causal LM's softmax over [no, yes] at the last token, at yes."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    return sigmoid((logits[token_ids[1]] - logits[token_ids[0]]).item())


# ---------------------------------------------------------------- LLM.score


def test_llm_score_of_text_pairs_is_the_classifiers_sigmoid_of_each_pair(
    reranker: LLM, tokenizer, hf_reranker
) -> None:
    """1 -> N and N -> N in data_2's order: each pair one engine request (its own id and
    sequence), the pair encoded as the tokenizer encodes a text pair."""
    one_to_many = reranker.score(QUERY, DOCUMENTS, use_tqdm=False)
    pairwise = reranker.score([QUERY, DOCUMENTS[1]], DOCUMENTS[:2])
    for document, output in zip(DOCUMENTS, one_to_many):
        ids = pair_ids(tokenizer, QUERY, document)
        assert output.finished and output.prompt_token_ids == ids
        assert output.outputs.score == pytest.approx(hf_score(hf_reranker, ids), abs=ATOL)
    assert len({output.request_id for output in one_to_many}) == len(DOCUMENTS)
    expected = [
        hf_score(hf_reranker, pair_ids(tokenizer, first, second))
        for first, second in ((QUERY, DOCUMENTS[0]), (DOCUMENTS[1], DOCUMENTS[1]))
    ]
    assert [output.outputs.score for output in pairwise] == pytest.approx(expected, abs=ATOL)


def test_llm_score_of_token_ids_joins_each_pair(reranker: LLM, hf_reranker) -> None:
    query, *documents = random_prompts(400, [7, 20, 3, 33], seed=9)
    one_to_many = reranker.score(query, documents)
    pairwise = reranker.score([query, documents[0]], documents[1:])
    assert [out.prompt_token_ids for out in one_to_many] == [query + d for d in documents]
    expected = [hf_score(hf_reranker, query + d) for d in documents]
    assert [out.outputs.score for out in one_to_many] == pytest.approx(expected, abs=ATOL)
    firsts = [query, documents[0]]
    expected = [hf_score(hf_reranker, a + b) for a, b in zip(firsts, documents[1:])]
    assert [out.outputs.score for out in pairwise] == pytest.approx(expected, abs=ATOL)


def test_pairs_that_do_not_fit_are_value_errors(reranker: LLM, tokenizer, hf_reranker) -> None:
    """Lists that do not pair, a text with token ids, a pair past the context; a pair cut to
    its last tokens (truncate_prompt_tokens) scores them."""
    for first, second, message in (
        ([QUERY, QUERY], DOCUMENTS, "1 -> N"),
        ([], DOCUMENTS, "must not be empty"),
        (QUERY, [[1, 2]], "a text with a text"),
        ([1] * 100, [[2] * 29], "maximum context length is 128"),
    ):
        with pytest.raises(ValueError, match=message):
            reranker.score(first, second)
    cut = reranker.score([1] * 100, [[2] * 29], truncate_prompt_tokens=40)[0]
    assert cut.prompt_token_ids == [1] * 11 + [2] * 29
    assert cut.outputs.score == pytest.approx(hf_score(hf_reranker, [1] * 11 + [2] * 29), abs=ATOL)
    assert not reranker.supervisor.restarts


# ---------------------------------------------------------------- the HTTP server


@pytest.fixture(scope="module")
def server(models):
    config = EngineConfig(
        model=str(models["reranker"]), **ENGINE,
        server=ServerConfig(port=free_port(), served_model_name="tiny", max_prompts_per_request=8),
    )  # fmt: skip
    with running_server(config) as base:
        yield base


def expected_scores(tokenizer, model, first: list[str], second: list[str]) -> list[float]:
    firsts = first * len(second) if len(first) == 1 else first
    return [hf_score(model, pair_ids(tokenizer, a, b)) for a, b in zip(firsts, second)]


def test_score_answers_each_pairs_score_in_vllms_shape(server: str, tokenizer, hf_reranker) -> None:
    """1 -> N and N -> N, in text_2's order; usage counts every pair's sequence."""
    expected = expected_scores(tokenizer, hf_reranker, [QUERY], DOCUMENTS)
    answer = httpx.post(server + "/score", json={"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert answer["id"].startswith("score-") and answer["object"] == "list"
    assert [item["index"] for item in answer["data"]] == list(range(len(DOCUMENTS)))
    assert [item["score"] for item in answer["data"]] == pytest.approx(expected, abs=ATOL)
    tokens = sum(len(pair_ids(tokenizer, QUERY, document)) for document in DOCUMENTS)
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    texts_1 = [QUERY, DOCUMENTS[1]]
    body = {"model": "tiny", "text_1": texts_1, "text_2": DOCUMENTS[:2]}
    pairwise = httpx.post(server + "/v1/score", json=body).json()
    expected = expected_scores(tokenizer, hf_reranker, texts_1, DOCUMENTS[:2])
    assert [item["score"] for item in pairwise["data"]] == pytest.approx(expected, abs=ATOL)


def test_rerank_orders_the_documents_by_the_cross_encoders_score(
    server: str, tokenizer, hf_reranker
) -> None:
    expected = expected_scores(tokenizer, hf_reranker, [QUERY], DOCUMENTS)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    assert order != sorted(order) and np.diff(sorted(expected)).min() > 1e-4
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = {"model": "tiny", "query": QUERY, "documents": DOCUMENTS}
        answer = httpx.post(server + path, json=body).json()
        assert answer["id"].startswith("rerank-") and answer["model"] == "tiny"
        assert [result["index"] for result in answer["results"]] == order
        for result in answer["results"]:
            assert result["document"] == {"text": DOCUMENTS[result["index"]]}
            assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=ATOL)
    body = {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}
    best = httpx.post(server + "/v1/rerank", json=body).json()["results"]
    assert [result["index"] for result in best] == order[:2]


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "1 -> N"),
        ("/score", {"text_1": "a", "text_2": []}, "text_2 must not be empty"),
        ("/score", {"text_1": "a", "text_2": ["b"] * 8}, "at most 8 texts"),
        ("/score", {"text_1": "x " * 150, "text_2": "b"}, "maximum context length is 128"),
        ("/score", {"text_1": [[1, 2]], "text_2": "a"}, "Expected `str`"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n must be at"),
        ("/rerank", {"query": "a", "documents": ["b"], "truncate_prompt_tokens": 0}, "-1 or at"),
    ],
)
def test_bad_score_and_rerank_bodies_are_400s(
    server: str, path: str, body: dict, message: str
) -> None:
    reply = httpx.post(server + path, json={"model": "tiny", **body})
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]["message"]


def test_the_engines_tokenizer_encodes_a_text_pair_for_a_classification_only(
    models, tokenizer
) -> None:
    """What a ZeroMQ client gets: GenerateRequest.prompt_pair is encoded as a text pair by
    the engine's tokenizer, and refused (a 400) without a text prompt or a classification."""
    config = {"architectures": ["LlamaForSequenceClassification"], "num_labels": 1}
    encoder = PromptEncoder(tokenizer, len(tokenizer), MAX_MODEL_LEN, model_config=config)
    classify = PoolingParams(task="classify")

    def request(**fields) -> GenerateRequest:
        return GenerateRequest(seq=0, sampling=pooling_sampling(), prompt_pair="to be", **fields)

    ids = encoder.encode(request(prompt=QUERY, pooling=classify))
    assert ids == pair_ids(tokenizer, QUERY, "to be")
    for fields, message in (
        ({"prompt": QUERY, "pooling": PoolingParams()}, "task classify"),
        ({"prompt_token_ids": [1, 2], "pooling": classify}, "pairs with a text prompt"),
    ):
        with pytest.raises(ValueError, match=message):
            encoder.encode(request(**fields))


# ---------------------------------------------------------------- a causal LM as reranker


def test_qwen3_reranker_overrides_score_the_yes_no_softmax_of_the_causal_lm(models) -> None:
    """vLLM's Qwen3-Reranker recipe: the score head is the LM head's row of "yes" minus that
    of "no", and the pair is the two texts joined (no separator), so the score is
    softmax([logit_no, logit_yes])[yes] of the causal LM at the joined text's last token."""
    path = models["qwen3"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    causal = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    token_ids = tokenizer.convert_tokens_to_ids(TOKENS)
    with LLM(str(path), hf_overrides=RERANKER_OVERRIDES, **ENGINE) as llm:
        scores = llm.score(QUERY, DOCUMENTS[:2])
        classified = llm.classify([QUERY])
    for document, output in zip(DOCUMENTS, scores):
        ids = tokenizer(QUERY + document)["input_ids"]
        assert output.prompt_token_ids == ids
        expected = hf_yes_no_score(causal, ids, token_ids)
        assert output.outputs.score == pytest.approx(expected, abs=ATOL)
    assert classified[0].outputs.num_classes == 1


def test_a_tied_lm_head_gives_its_rows_from_the_embedding(models) -> None:
    """no_post_processing with one token: the head is that token's row of the LM head, which
    a model with tied embeddings keeps in its embedding; its one logit is the causal LM's
    logit of the token."""
    path = models["tied"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    causal = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    overrides = {
        "architectures": ["LlamaForSequenceClassification"],
        "classifier_from_token": TOKENS[1:],
        "method": "no_post_processing",
    }
    prompt = random_prompts(400, [12], seed=4)[0]
    with LLM(str(path), hf_overrides=overrides, skip_tokenizer_init=True, **ENGINE) as llm:
        score = llm.score(prompt[:5], [prompt[5:]])[0].outputs.score
    with torch.inference_mode():
        logit = causal(torch.tensor([prompt])).logits[
            0, -1, tokenizer.convert_tokens_to_ids(TOKENS[1])
        ]
    assert score == pytest.approx(sigmoid(logit.item()), abs=ATOL)


QWEN3_CLASSIFIER = {"architectures": ["Qwen3ForSequenceClassification"]}
LLAMA_CLASSIFIER = {"architectures": ["LlamaForSequenceClassification"]}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (QWEN3_CLASSIFIER | {"classifier_from_token": TOKENS}, "needs a method"),
        (QWEN3_CLASSIFIER | {"classifier_from_token": TOKENS, "method": "softmax"}, "got 'softm"),
        (RERANKER_OVERRIDES | {"classifier_from_token": ["no"]}, "needs two tokens"),
        (RERANKER_OVERRIDES | {"classifier_from_token": ["no", "zz-9"]}, r"\['zz-9'\] not in"),
        ({"classifier_from_token": TOKENS, "method": "no_post_processing"}, "ForSequenceClass"),
        (RERANKER_OVERRIDES | LLAMA_CLASSIFIER, "needs a method"),
    ],
)
def test_overrides_vllm_refuses_are_value_errors_before_the_engine_starts(
    models, overrides: dict, message: str
) -> None:
    """classifier_from_token needs a method of vLLM's (is_original_qwen3_reranker names one
    for Qwen3ForSequenceClassification only), the tokens it needs, in the vocabulary, and a
    sequence-classification architecture."""
    with pytest.raises(ValueError, match=message):
        LLM(str(models["qwen3"]), hf_overrides=overrides, **ENGINE)
