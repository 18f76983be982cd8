"""A server started with settings (a short health-check deadline, the model's generation
config, a chat template): /health and /v1/models tell the truth about the engine (200 only
while it answers), the latency metrics count from a request's arrival, waiting included, and
requests that leave a sampling field unset get the generation config's value."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import openai
import psutil
import pytest

from pagedserve.actors.chat import load_tokenizer
from pagedserve.actors.supervisor import Supervisor
from pagedserve.api.client import AsyncClient
from pagedserve.api.openai_server import OpenAIServer, build_app
from pagedserve.config import EngineConfig, ServerConfig
from tests.engine_settings import NO_STANDBY
from tests.test_openai_server import free_port
from tests.tiny_models import save_tiny_model

HEALTH_TIMEOUT_S = 0.5


GENERATION_CONFIG = {"temperature": 0.0, "max_new_tokens": 6}  # greedy, at most 6 tokens
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = save_tiny_model("llama", tmp_path_factory.mktemp("settings"))
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return path


@pytest.fixture(scope="module")
def server(model_path: Path):
    port = free_port()
    config = EngineConfig(
        model=str(model_path),
        max_model_len=128,
        num_kv_blocks=64,
        chat_template=CHAT_TEMPLATE,
        server=ServerConfig(port=port, health_check_timeout_s=HEALTH_TIMEOUT_S),
        supervision=NO_STANDBY,
    )
    supervisor = Supervisor(config)
    supervisor.start(extra_actors=("api-server",))
    try:
        yield supervisor, f"http://127.0.0.1:{port}"
    finally:
        supervisor.stop()


def wait_for_status(url: str, status: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(url, timeout=10).status_code == status:
            return True
        time.sleep(0.1)
    return False


def histogram_sum_and_count(metrics: str, name: str) -> tuple[float, float]:
    def value(suffix: str) -> float:
        match = re.search(rf"^pagedserve:{name}_{suffix} ([0-9.e+-]+)$", metrics, re.M)
        assert match, name
        return float(match.group(1))

    return value("sum"), value("count")


async def test_health_and_models_are_503_while_no_engine_answers(tmp_path, model_path) -> None:
    config = EngineConfig(
        model=str(model_path), server=ServerConfig(health_check_timeout_s=0.2)
    ).resolve()
    nobody = f"ipc://{tmp_path}/nobody-listens"
    async with AsyncClient(nobody, credentials="key", connect_timeout_s=None) as client:
        app = build_app(OpenAIServer(client, config, load_tokenizer(str(model_path)), {}))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as http:
            assert (await http.get("/health")).status_code == 503
            models = await http.get("/v1/models")
            assert models.status_code == 503 and "Retry-After" in models.headers
            assert models.json()["error"]["type"] == "service_unavailable"


def test_health_is_503_while_the_engine_is_stuck(server) -> None:
    supervisor, base = server
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/v1/models").status_code == 200
    scheduler = psutil.Process(supervisor.processes["scheduler"].pid)
    scheduler.suspend()  # SIGSTOP: alive, but it answers nothing
    try:
        assert wait_for_status(base + "/health", 503, timeout_s=10)
        assert httpx.get(base + "/v1/models").status_code == 503
    finally:
        scheduler.resume()
    assert wait_for_status(base + "/health", 200, timeout_s=10)


def test_ttft_and_e2e_count_the_wait_from_arrival(server) -> None:
    supervisor, base = server
    api = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    before = httpx.get(base + "/metrics").text
    scheduler = psutil.Process(supervisor.processes["scheduler"].pid)
    wait_s = 0.6
    with ThreadPoolExecutor(1) as pool:
        scheduler.suspend()
        try:
            future = pool.submit(
                lambda: list(
                    api.completions.create(
                        model=supervisor.config.model, prompt="x", max_tokens=4, stream=True
                    )
                )
            )
            time.sleep(wait_s)  # the request has arrived and waits for the engine
        finally:
            scheduler.resume()
        assert future.result(timeout=60)
    after = httpx.get(base + "/metrics").text
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        (sum_before, count_before), (sum_after, count_after) = (
            histogram_sum_and_count(text, name) for text in (before, after)
        )
        assert count_after == count_before + 1
        assert sum_after - sum_before >= wait_s - 0.1, name


def test_unset_fields_take_the_generation_config(server) -> None:
    supervisor, base = server
    api = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    model = supervisor.config.model
    kwargs = dict(model=model, prompt="To be", extra_body={"ignore_eos": True})
    default = api.completions.create(max_tokens=100, **kwargs).choices[0]
    greedy = api.completions.create(max_tokens=6, temperature=0, **kwargs).choices[0]
    assert default.text == greedy.text and default.finish_reason == "length"
    unset = api.completions.create(**kwargs)  # OpenAI's default of 16, under the config's 6
    assert unset.usage.completion_tokens == 6
    sampled = [
        api.completions.create(max_tokens=6, temperature=1.5, seed=s, **kwargs).choices[0].text
        for s in range(4)
    ]
    assert len(set(sampled)) > 1  # a field the request sets wins


def test_the_chat_template_setting_renders_chat_prompts(server, model_path) -> None:
    base = server[1]
    messages = [{"role": "user", "content": "Who art thou?"}]
    tokens = httpx.post(base + "/tokenize", json={"messages": messages}).json()["tokens"]
    tokenizer = load_tokenizer(str(model_path))
    assert tokens == tokenizer.encode("<user>Who art thou?", add_special_tokens=False)
