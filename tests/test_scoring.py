"""Scores of text pairs for an embedding model (vLLM's score and rerank APIs, bi-encoder):
`LLM.score`, `POST /score` (`/v1/score`) and `POST /rerank` (`/v1/rerank`, `/v2/rerank`). A
pair's score is the cosine similarity of the two texts' embeddings, transformers' the oracle
(tests/test_embeddings.py's `hf_embedding`); one text against many or two lists pair by pair;
each distinct text embedded once; the documents ranked best first, cut to top_n; bad bodies
are 400s, an unknown model a 404, and a LoRA adapter is chosen by `model`."""

from __future__ import annotations

from pathlib import Path

import httpx2 as httpx
import numpy as np
import openai
import pytest
import transformers

from pagedserve import LLM
from pagedserve.config import EngineConfig, ServerConfig
from tests.engine_settings import NO_STANDBY
from tests.test_openai_server import free_port, running_server
from tests.tiny_models import (
    hf_embedding,
    load_hf_model,
    merge_lora,
    random_prompts,
    save_lora_adapter,
    save_tiny_model,
)

ATOL = 1e-5
MAX_MODEL_LEN = 128
MAX_TEXTS = 8  # the server's max_prompts_per_request
MAX_CHARS = 2000  # the server's max_prompt_chars
QUERY = "To be, or not to be"
DOCUMENTS = ["that is the question", "To be, or not", "Whether tis nobler", "to be"]


def cosine(a: list[float], b: list[float]) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("scoring"))


@pytest.fixture(scope="module")
def adapter(model_path: Path, tmp_path_factory) -> Path:
    return save_lora_adapter(model_path, tmp_path_factory.mktemp("adapter"), seed=3)


@pytest.fixture(scope="module")
def hf_model(model_path: Path) -> transformers.PreTrainedModel:
    return load_hf_model(model_path)


@pytest.fixture(scope="module")
def server(model_path: Path, adapter: Path):
    port = free_port()
    limits = ServerConfig(
        port=port, served_model_name="tiny", max_prompts_per_request=MAX_TEXTS,
        max_prompt_chars=MAX_CHARS, lora_modules={"adapted": str(adapter)},
    )  # fmt: skip
    config = EngineConfig(
        model=str(model_path), max_model_len=MAX_MODEL_LEN, num_kv_blocks=128,
        enable_lora=True, supervision=NO_STANDBY, server=limits,
    )  # fmt: skip
    with running_server(config) as base:
        yield base


def token_ids(server: str, text: str) -> list[int]:
    """The text's tokens as the engine makes them (the tokenizer's special tokens included)."""
    return httpx.post(server + "/tokenize", json={"prompt": text}).json()["tokens"]


def expected_scores(
    server: str, model: transformers.PreTrainedModel, first: list[str], second: list[str]
) -> list[float]:
    """transformers' cosine of each pair (first: one text, or one per text of second)."""
    vectors = {t: hf_embedding(model, token_ids(server, t), "LAST") for t in {*first, *second}}
    firsts = first * len(second) if len(first) == 1 else first
    return [cosine(vectors[a], vectors[b]) for a, b in zip(firsts, second)]


def num_tokens(server: str, texts: set[str]) -> int:
    return sum(len(token_ids(server, text)) for text in texts)


# ---------------------------------------------------------------- /score


def test_score_one_text_against_many_is_the_cosine_of_transformers_embeddings(
    server: str, hf_model
) -> None:
    """1 -> N in text_2's order (a text twice scores twice, embedded once: the usage counts
    each distinct text's tokens once); /score and /v1/score are the same endpoint."""
    texts_2 = [*DOCUMENTS, DOCUMENTS[0]]
    expected = expected_scores(server, hf_model, [QUERY], texts_2)
    for path in ("/score", "/v1/score"):
        body = {"model": "tiny", "text_1": QUERY, "text_2": texts_2}
        answer = httpx.post(server + path, json=body).json()
        assert answer["id"].startswith("score-") and answer["object"] == "list"
        assert isinstance(answer["created"], int) and answer["model"] == "tiny"
        assert [item["index"] for item in answer["data"]] == list(range(len(texts_2)))
        assert all(item["object"] == "score" for item in answer["data"])
        scores = [item["score"] for item in answer["data"]]
        assert scores == pytest.approx(expected, abs=ATOL)
        tokens = num_tokens(server, {QUERY, *DOCUMENTS})
        assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_score_pairs_two_lists_and_the_openai_client_posts_it(server: str, hf_model) -> None:
    """N -> N: text_1[i] with text_2[i]; a one-text list is 1 -> N, as a string is; the
    official client's generic post reaches /v1/score."""
    api = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    texts_1 = [QUERY, DOCUMENTS[1], DOCUMENTS[2]]
    texts_2 = DOCUMENTS[:3]
    body = {"model": "tiny", "text_1": texts_1, "text_2": texts_2}
    answer = api.post("/score", body=body, cast_to=object)
    expected = expected_scores(server, hf_model, texts_1, texts_2)
    assert [item["score"] for item in answer["data"]] == pytest.approx(expected, abs=ATOL)
    one = httpx.post(server + "/v1/score", json={"text_1": [QUERY], "text_2": DOCUMENTS[0]})
    assert one.json()["data"][0]["score"] == pytest.approx(expected[0], abs=ATOL)


def test_an_adapter_named_by_model_scores_with_its_embeddings(
    server: str, model_path: Path, adapter: Path
) -> None:
    merged = merge_lora(model_path, adapter)
    body = {"model": "adapted", "text_1": QUERY, "text_2": DOCUMENTS[:2]}
    answer = httpx.post(server + "/v1/score", json=body).json()
    assert answer["model"] == "adapted"
    expected = expected_scores(server, merged, [QUERY], DOCUMENTS[:2])
    assert [item["score"] for item in answer["data"]] == pytest.approx(expected, abs=ATOL)
    plain = httpx.post(server + "/v1/score", json=body | {"model": "tiny"}).json()
    assert plain["data"][0]["score"] != pytest.approx(expected[0], abs=1e-3)


# ---------------------------------------------------------------- /rerank


def test_rerank_orders_the_documents_best_first_and_keeps_top_n(server: str, hf_model) -> None:
    """/rerank, /v1/rerank and /v2/rerank: every document by its score against the query
    (the same as /score's), best first, each with its index and text; top_n keeps the best
    that many (0, vLLM's default, and more than there are: all)."""
    expected = expected_scores(server, hf_model, [QUERY], DOCUMENTS)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    gaps = np.diff(sorted(expected))
    assert order != sorted(order) and gaps.min() > 1e-3  # a real reordering, with no near-ties
    for path, top_n in (("/rerank", None), ("/v1/rerank", 0), ("/v2/rerank", 9)):
        body = {"model": "tiny", "query": QUERY, "documents": DOCUMENTS}
        answer = httpx.post(server + path, json=body | ({} if top_n is None else {"top_n": top_n}))
        answer = answer.json()
        assert answer["id"].startswith("rerank-") and answer["model"] == "tiny"
        assert [r["index"] for r in answer["results"]] == order
        for result in answer["results"]:
            assert result["document"] == {"text": DOCUMENTS[result["index"]]}
            assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=ATOL)
        assert answer["usage"] == {"total_tokens": num_tokens(server, {QUERY, *DOCUMENTS})}
    body = {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}
    best = httpx.post(server + "/v1/rerank", json=body).json()["results"]
    assert [r["index"] for r in best] == order[:2]


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/v1/score", {"text_1": [], "text_2": "a"}, "text_1 must not be empty"),
        ("/v1/score", {"text_1": "a", "text_2": []}, "text_2 must not be empty"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "1 -> N"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": "c"}, "text_1 has 2 texts"),
        ("/v1/score", {"text_1": "a", "text_2": ["b"] * MAX_TEXTS}, f"at most {MAX_TEXTS} texts"),
        ("/v1/score", {"text_1": "a", "text_2": "x" * (MAX_CHARS + 1)}, "at most 2000 char"),
        ("/v1/score", {"text_1": "a", "text_2": ""}, "the prompt is empty"),
        ("/v1/score", {"text_1": 5, "text_2": "a"}, "Expected `str | array`"),
        ("/v1/score", {"text_1": [[1, 2]], "text_2": "a"}, "Expected `str`"),
        ("/v1/score", {"text_2": "a"}, "missing required field `text_1`"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0}, "-1 or at"),
        ("/v1/rerank", {"query": "a", "documents": []}, "documents must not be empty"),
        ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n must be at"),
        ("/v1/rerank", {"query": ["a"], "documents": ["b"]}, "Expected `str`"),
        ("/v1/rerank", {"query": "a", "documents": "b"}, "Expected `array`"),
        ("/v2/rerank", {"query": "a", "documents": ["b"] * MAX_TEXTS}, "at most 8 texts"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": 2**64}, "invalid request"),
    ],
)
def test_bad_score_and_rerank_bodies_are_400s(
    server: str, path: str, body: dict, message: str
) -> None:
    reply = httpx.post(server + path, json={"model": "tiny", **body})
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/score", "/v1/rerank"])
def test_an_unknown_model_is_a_404(server: str, path: str) -> None:
    body = {"model": "nope", "text_1": "a", "text_2": "b", "query": "a", "documents": ["b"]}
    reply = httpx.post(server + path, json=body)
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"


# ---------------------------------------------------------------- LLM.score


def test_llm_score_is_the_cosine_of_its_embeddings(model_path: Path, hf_model) -> None:
    """Token ids and texts, 1 -> N and N -> N, in data_2's order, vLLM's output shape (the
    pair's ids joined, both prompts' tokens); each distinct text embedded once (one request
    id per text); lists that do not pair are a ValueError. The engine pools MEAN without
    normalizing, so the score divides by the norms."""
    query, *documents = random_prompts(400, [7, 20, 3, 33], seed=9)

    def expected(a: list[int], b: list[int]) -> float:
        mean = [hf_embedding(hf_model, prompt, "MEAN", normalize=False) for prompt in (a, b)]
        return cosine(*mean)

    with LLM(
        str(model_path), max_model_len=MAX_MODEL_LEN, num_kv_blocks=64,
        pooler_config={"pooling_type": "MEAN", "normalize": False}, supervision=NO_STANDBY,
    ) as llm:  # fmt: skip
        one_to_many = llm.score(query, [*documents, documents[0]], use_tqdm=False)
        pairwise = llm.score([query, documents[1]], documents[:2])
        texts = llm.score(QUERY, DOCUMENTS[:2])
        embedded = llm.embed([QUERY, *DOCUMENTS[:2]])
        for first, second in (([query, query], documents), ([], documents), (query, [])):
            with pytest.raises(ValueError, match="1 -> N|must not be empty"):
                llm.score(first, second)
    scores = [out.outputs.score for out in one_to_many]
    wanted = [expected(query, d) for d in [*documents, documents[0]]]
    assert scores == pytest.approx(wanted, abs=ATOL)
    assert [out.prompt_token_ids for out in one_to_many[:3]] == [query + d for d in documents]
    ids = [out.request_id.split("_") for out in one_to_many]
    assert len({first for first, _ in ids}) == 1 and ids[3] == ids[0]
    assert len({second for _, second in ids}) == 3 and all(out.finished for out in one_to_many)
    assert [out.outputs.score for out in pairwise] == pytest.approx(
        [expected(query, documents[0]), expected(documents[1], documents[1])], abs=ATOL
    )
    vectors = [out.outputs.embedding for out in embedded]
    assert [out.outputs.score for out in texts] == pytest.approx(
        [cosine(vectors[0], vectors[1]), cosine(vectors[0], vectors[2])], abs=ATOL
    )
