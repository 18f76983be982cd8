"""Fuzzing the HTTP server: 2,000+ generated bodies (valid, near-valid and hostile: huge ints,
floats for ints, nested junk, wrong types, empty lists, unicode, huge n, wrong Content-Type) to
both generation endpoints, the embeddings endpoint (inputs or chat messages), the score and
rerank endpoints and the Responses endpoint of one real server. None may get a 5xx, a text/plain
body never runs, and afterwards the engine still serves with every KV block free."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anyio
import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pagedserve.actors.supervisor import Supervisor
from pagedserve.config import EngineConfig, ServerConfig
from tests.engine_settings import NO_STANDBY
from tests.test_openai_server import free_port
from tests.tiny_models import save_tiny_model

NUM_BODIES = 2000  # a third of them to each generation endpoint
CONCURRENCY = 16  # requests in flight at once: the engine batches the valid ones
NUM_KV_BLOCKS = 128
MAX_FAILURES = 5
MODEL = "fuzz"
VOCAB = 400  # the tiny test tokenizer's

EDGE_INTS = st.sampled_from(
    [2**63, 2**63 - 1, 2**64, 2**64 - 1, -(2**63), -(2**63) - 1, 10**30, -1, 0, 10**9]
)
FLOATS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1e30, -1e-30, 0.5, 2.0])
)
TEXT = st.text(max_size=24)
JUNK = st.recursive(
    st.none() | st.booleans() | EDGE_INTS | FLOATS | TEXT,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=16,
)
HOSTILE = st.one_of(
    EDGE_INTS, EDGE_INTS, FLOATS, TEXT, JUNK, st.sampled_from([[], {}, None, "", [[]], [-1], True])
)
TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)
SCORE_PATHS = ["/score", "/v1/score"]
RERANK_PATHS = ["/rerank", "/v1/rerank", "/v2/rerank"]
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": TEXT}
)
SAMPLING = {  # valid values of every field both endpoints take
    "max_tokens": st.integers(1, 2),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "n": st.integers(1, 2),
    "seed": st.integers(0, 2**32),
    "stop": st.one_of(TEXT, st.lists(st.text(max_size=4), max_size=4)),
    "stop_token_ids": TOKEN_IDS,
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 3),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": TEXT,
    "use_beam_search": st.booleans(),
    "length_penalty": st.floats(-2, 2),
}
COMPLETION_PROMPTS = st.one_of(
    TEXT,
    TOKEN_IDS,
    st.lists(TEXT, min_size=1, max_size=2),
    st.lists(TOKEN_IDS, min_size=1, max_size=2),
)
COMPLETION = st.fixed_dictionaries(
    {"prompt": COMPLETION_PROMPTS},
    optional={
        **SAMPLING,
        "model": st.just(MODEL),
        "logprobs": st.integers(0, 5),
        "echo": st.booleans(),
    },
)
CHAT = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, min_size=1, max_size=3)},
    optional={
        **SAMPLING,
        "model": st.just(MODEL),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 5),
        "max_completion_tokens": st.integers(1, 2),
    },
)
EMBEDDING = st.fixed_dictionaries(
    {"input": COMPLETION_PROMPTS},
    optional={
        "model": st.just(MODEL),
        "encoding_format": st.sampled_from(["float", "base64"]),
        "dimensions": st.integers(1, 64),
        "add_special_tokens": st.booleans(),
        "truncate_prompt_tokens": st.integers(1, 8),
        "user": TEXT,
    },
)
CHAT_EMBEDDING = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, min_size=1, max_size=3)},
    optional={
        "model": st.just(MODEL),
        "encoding_format": st.sampled_from(["float", "base64"]),
        "dimensions": st.integers(1, 64),
        "add_generation_prompt": st.booleans(),
        "continue_final_message": st.booleans(),
        "add_special_tokens": st.booleans(),
        "truncate_prompt_tokens": st.integers(1, 8),
    },
)
RESPONSE_PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text"]), "text": TEXT}
)
RESPONSE_ITEM = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "developer", "assistant"]),
        "content": st.one_of(TEXT, st.lists(RESPONSE_PART, min_size=1, max_size=2)),
    },
    optional={"type": st.just("message")},
)
RESPONSES = st.fixed_dictionaries(
    {"input": st.one_of(TEXT, st.lists(RESPONSE_ITEM, min_size=1, max_size=3))},
    optional={
        "model": st.just(MODEL),
        "instructions": TEXT,
        "max_output_tokens": st.integers(1, 2),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "stream": st.booleans(),
        "user": TEXT,
        "metadata": st.dictionaries(st.text(max_size=6), TEXT, max_size=2),
        "store": st.booleans(),
        "text": st.just({"format": {"type": "text"}}),
    },
)
TEXTS = st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=3))
SCORE = st.fixed_dictionaries(
    {"text_1": TEXTS, "text_2": TEXTS},
    optional={"model": st.just(MODEL), "truncate_prompt_tokens": st.integers(1, 8)},
)
RERANK = st.fixed_dictionaries(
    {"query": TEXT, "documents": st.lists(TEXT, min_size=1, max_size=4)},
    optional={
        "model": st.just(MODEL),
        "top_n": st.integers(0, 5),
        "truncate_prompt_tokens": st.integers(1, 8),
    },
)
KEYS = [
    *SAMPLING, "prompt", "messages", "input", "encoding_format", "dimensions", "model",
    "logprobs", "echo", "top_logprobs", "best_of",
    "max_completion_tokens", "logit_bias", "suffix", "tools", "tool_choice", "response_format",
    "prompt_logprobs", "guided_json", "guided_regex", "guided_choice", "structured_outputs",
    "bad_words", "guided_grammar", "unknown_field", "truncate_prompt_tokens",
    "add_generation_prompt", "continue_final_message", "text_1", "text_2", "query", "documents",
    "top_n", "instructions", "max_output_tokens", "previous_response_id", "text", "metadata",
]  # fmt: skip
EXTRA_MUTATIONS = st.lists(
    st.one_of(st.tuples(st.sampled_from(KEYS), HOSTILE), st.tuples(st.sampled_from(KEYS))),
    max_size=2,
)


def mutated(body: dict, mutations: list[tuple]) -> dict:
    """`body` with some fields set to hostile values (key, value) or removed (key,)."""
    body = dict(body)
    for mutation in mutations:
        if len(mutation) == 2:
            body[mutation[0]] = mutation[1]
        else:
            body.pop(mutation[0], None)
    return body


REQUESTS = st.one_of(
    st.tuples(st.just("/v1/completions"), st.builds(mutated, COMPLETION, EXTRA_MUTATIONS)),
    st.tuples(st.just("/v1/chat/completions"), st.builds(mutated, CHAT, EXTRA_MUTATIONS)),
    st.tuples(
        st.just("/v1/embeddings"),
        st.one_of(
            st.builds(mutated, EMBEDDING, EXTRA_MUTATIONS),
            st.builds(mutated, CHAT_EMBEDDING, EXTRA_MUTATIONS),
        ),
    ),
    st.tuples(st.sampled_from(SCORE_PATHS), st.builds(mutated, SCORE, EXTRA_MUTATIONS)),
    st.tuples(st.sampled_from(RERANK_PATHS), st.builds(mutated, RERANK, EXTRA_MUTATIONS)),
    st.tuples(st.just("/v1/responses"), st.builds(mutated, RESPONSES, EXTRA_MUTATIONS)),
)
CONTENT_TYPES = st.sampled_from(
    ["application/json", "application/json", "application/json; charset=utf-8", "text/plain", None]
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_path: Path = save_tiny_model("llama", tmp_path_factory.mktemp("fuzz"))
    # the generation config caps every request's max_tokens (as vLLM applies it): a valid
    # body costs a few decode steps, whatever it asks for
    (model_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 2}))
    port = free_port()
    config = EngineConfig(
        model=str(model_path),
        max_model_len=64,
        num_kv_blocks=NUM_KV_BLOCKS,
        server=ServerConfig(port=port, served_model_name=MODEL, max_n=8, max_prompts_per_request=8),
        supervision=NO_STANDBY,
    )
    supervisor = Supervisor(config)
    supervisor.start(extra_actors=("api-server",))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        supervisor.stop()


def encode(body: dict, raw_unicode: bool) -> bytes:
    """JSON text, escaped or as raw UTF-8 (lone surrogates then make invalid UTF-8)."""
    return json.dumps(body, ensure_ascii=not raw_unicode).encode("utf-8", "surrogatepass")


def check_reply(response: httpx.Response, path: str, content_type: str | None) -> None:
    assert response.status_code < 500, response.text[:300]
    if content_type is None or not content_type.startswith("application/json"):
        assert response.status_code == 415
    elif response.status_code != 200:
        assert set(response.json()["error"]) >= {"message", "type", "code"}
    elif path == "/v1/responses":
        check_responses_reply(response)
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n")
    elif path == "/v1/embeddings":
        data = response.json()["data"]
        assert data and all(item["embedding"] for item in data)
    elif path in SCORE_PATHS:
        scores = [item["score"] for item in response.json()["data"]]
        assert scores and all(abs(score) <= 1 + 1e-5 for score in scores)
    elif path in RERANK_PATHS:
        scores = [result["relevance_score"] for result in response.json()["results"]]
        assert scores and scores == sorted(scores, reverse=True)
    else:
        assert response.json()["choices"]


def check_responses_reply(response: httpx.Response) -> None:
    """A Response object, whole or as the data of a stream's one final event, the last."""
    if not response.headers["content-type"].startswith("text/event-stream"):
        assert response.json()["object"] == "response"
        return
    last = response.text.rstrip("\n").split("\n\n")[-1]
    assert last.split("\n")[0] in ("event: response.completed", "event: response.failed")
    finals = response.text.count("event: response.completed")
    assert finals + response.text.count("event: response.failed") == 1


def metric(text: str, name: str) -> float:
    match = re.search(rf"^pagedserve:{name} ([0-9.e+-]+)$", text, re.M)
    assert match, name
    return float(match.group(1))


def generated_requests() -> list[tuple[str, bytes, dict[str, str]]]:
    """NUM_BODIES (path, body, headers), the same ones every run. Body i also gets a hostile
    value in field KEYS[i % len(KEYS)] (every 8th is left alone), so that every field gets its
    share of hostile values in otherwise valid bodies, the ones that go deepest."""
    requests: list[tuple[str, bytes, dict[str, str]]] = []

    @settings(
        max_examples=NUM_BODIES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(request=REQUESTS, hostile=HOSTILE, content_type=CONTENT_TYPES, raw_unicode=st.booleans())
    def collect(
        request: tuple[str, dict], hostile: Any, content_type: str | None, raw_unicode: bool
    ) -> None:
        path, body = request
        if len(requests) % 8:
            body = {**body, KEYS[len(requests) % len(KEYS)]: hostile}
        headers = {} if content_type is None else {"content-type": content_type}
        requests.append((path, encode(body, raw_unicode), headers))

    collect()
    return requests


async def send_all(base: str, requests: list[tuple[str, bytes, dict[str, str]]]) -> list[str]:
    """Sends every request, CONCURRENCY at a time; returns what went wrong, one line each
    (after MAX_FAILURES it stops: a dead engine would time every request out)."""
    failures: list[str] = []
    limit = anyio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY)
    async with (
        httpx.AsyncClient(base_url=base, timeout=20, limits=limits) as http,
        anyio.create_task_group() as tg,
    ):

        async def one(path: str, body: bytes, headers: dict[str, str]) -> None:
            async with limit:
                try:
                    response = await http.post(path, content=body, headers=headers)
                    check_reply(response, path, headers.get("content-type"))
                except (AssertionError, KeyError, httpx.HTTPError, ValueError) as exc:
                    failures.append(f"{path} {body[:300]!r} {headers}: {exc!r}"[:1000])
                    if len(failures) >= MAX_FAILURES:
                        tg.cancel_scope.cancel()

        for request in requests:
            tg.start_soon(one, *request)
    return failures


async def test_generated_bodies_get_no_5xx_and_leave_the_engine_whole(server: str) -> None:
    requests = generated_requests()
    assert len(requests) >= NUM_BODIES
    failures = await send_all(server, requests)
    assert failures == [], f"{len(failures)} failures, the first: " + "\n".join(failures[:5])
    async with httpx.AsyncClient(base_url=server, timeout=30) as http:
        ok = await http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "To be", "max_tokens": 2}
        )
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] > 0
        with anyio.fail_after(10):
            while True:
                metrics = (await http.get("/metrics")).text
                if metric(metrics, "kv_cache_free_blocks") == NUM_KV_BLOCKS:
                    break
                await anyio.sleep(0.1)
    assert metric(metrics, "num_requests_running") == metric(metrics, "num_requests_waiting") == 0
