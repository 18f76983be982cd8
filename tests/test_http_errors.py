"""How engine errors reach an HTTP client: the engine refusing work because its waiting queue
is full (EngineRequestError with status 503) is an HTTP 503 with Retry-After, streaming or not,
for generation and for the answers made of embeddings (embeddings, scores, reranking); a bad
request (400) is a 400. The app runs in-process against an engine stand-in that answers
every request with that error."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx2 as httpx
import pytest

from pagedserve.actors.chat import load_tokenizer
from pagedserve.actors.messages import (
    LoRARequest,
    PoolingParams,
    PromptOptions,
    RequestDelta,
    SamplingParams,
)
from pagedserve.api.client_core import EngineRequestError, Prompt
from pagedserve.api.errors import RETRY_AFTER_S
from pagedserve.api.openai_server import OpenAIServer, build_app
from pagedserve.config import EngineConfig, ServerConfig
from tests.tiny_models import save_tiny_model


class RefusingEngine:
    """The client interface of `AsyncClient`, refusing every request as the engine does."""

    def __init__(self, status_code: int) -> None:
        self.status_code = status_code

    async def generate(
        self,
        prompt: Prompt,
        sampling: SamplingParams,
        request_id: str | None = None,
        options: PromptOptions | None = None,
        priority: int = 0,
        lora: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
    ) -> AsyncIterator[RequestDelta]:
        raise EngineRequestError("the engine's waiting queue is full", self.status_code)
        yield  # an async generator, like the real client's


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("errors"))


async def post_to_refusing_engine(
    model_path: Path, status: int, path: str, body: dict
) -> httpx.Response:
    config = EngineConfig(model=str(model_path), server=ServerConfig()).resolve()
    server = OpenAIServer(RefusingEngine(status), config, load_tokenizer(str(model_path)), {})
    transport = httpx.ASGITransport(app=build_app(server))
    async with httpx.AsyncClient(transport=transport, base_url="http://server") as http:
        return await http.post(path, json=body)


@pytest.mark.parametrize("status", [503, 400])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [1, 3])
async def test_engine_refusals_are_http_errors(
    model_path, status: int, stream: bool, n: int
) -> None:
    body = {"prompt": "x", "max_tokens": 2, "n": n, "stream": stream}
    response = await post_to_refusing_engine(model_path, status, "/v1/completions", body)
    assert response.status_code == status
    assert response.json()["error"]["message"] == "the engine's waiting queue is full"
    if status == 503:
        assert response.headers["retry-after"] == str(RETRY_AFTER_S)
    else:
        assert "retry-after" not in response.headers


@pytest.mark.parametrize("status", [503, 400])
@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/embeddings", {"input": ["x", "y"]}),
        ("/v1/score", {"text_1": "x", "text_2": ["y", "z"]}),
        ("/v2/rerank", {"query": "x", "documents": ["y"]}),
    ],
)
async def test_engine_refusals_of_embeddings_are_http_errors(
    model_path, status: int, path: str, body: dict
) -> None:
    response = await post_to_refusing_engine(model_path, status, path, body)
    assert response.status_code == status
    assert response.json()["error"]["message"] == "the engine's waiting queue is full"
