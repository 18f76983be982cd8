"""The HTTP server, driven by the official `openai` client against real processes on a free
localhost port; the ZeroMQ client and the offline LLM on the same model as the reference."""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx2 as httpx
import msgspec
import openai
import pytest

import pagedserve
from pagedserve import LLM, SamplingParams
from pagedserve.actors.supervisor import Supervisor
from pagedserve.api.client import AsyncClient, Client
from pagedserve.api.protocol import ChatCompletionRequest
from pagedserve.config import EngineConfig, ServerConfig
from tests.engine_settings import NO_STANDBY
from tests.tiny_models import hf_beam_search, load_hf_model, pick_stop_string, save_tiny_model

MODEL_NAME = "tiny"
MAX_MODEL_LEN = 256
LIMITS = dict(
    max_request_body_bytes=1 << 20,
    max_json_depth=16,
    max_prompt_chars=50_000,
    max_prompts_per_request=64,
    max_n=16,
    max_stop_strings=8,
    max_stop_string_chars=32,
    max_stop_token_ids=8,
)


def tool(name: str, key: str, values: list[str]) -> dict:
    """A function tool of one argument, `key`, one of `values`."""
    parameters = {
        "type": "object",
        "properties": {key: {"enum": values}},
        "required": [key],
        "additionalProperties": False,
    }
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOOLS = [tool("weather", "city", ["Paris", "Rome"]), tool("clock", "zone", ["UTC", "CET"])]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(config: EngineConfig) -> Iterator[str]:
    """The engine of `config` with its API server (on config.server's port): its base URL,
    the engine stopped afterwards."""
    assert config.server is not None
    supervisor = Supervisor(config)
    supervisor.start(extra_actors=("api-server",))
    try:
        yield f"http://127.0.0.1:{config.server.port}"
    finally:
        supervisor.stop()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def server(model_path: Path):
    port = free_port()
    config = EngineConfig(
        model=str(model_path),
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=512,
        server=ServerConfig(port=port, served_model_name=MODEL_NAME, **LIMITS),
        supervision=NO_STANDBY,
    )
    supervisor = Supervisor(config)
    supervisor.start(extra_actors=("api-server",))
    try:
        yield supervisor, f"http://127.0.0.1:{port}"
    finally:
        supervisor.stop()


@pytest.fixture
def api(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="none", max_retries=0)


def metric(text: str, name: str, default: float | None = None) -> float:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    if match is None and default is not None:
        return default
    assert match, name
    return float(match.group(1))


def test_models_health_and_metrics(server, api: openai.OpenAI) -> None:
    assert [m.id for m in api.models.list().data] == [MODEL_NAME]
    assert httpx.get(server[1] + "/health").status_code == 200
    assert (
        httpx.get(server[1] + "/ping").status_code
        == httpx.post(server[1] + "/ping").status_code
        == 200
    )
    text = httpx.get(server[1] + "/metrics").text
    assert metric(text, "pagedserve:kv_cache_total_blocks") == 512
    assert "pagedserve:time_to_first_token_seconds_bucket" in text


def test_completion_usage_logprobs_and_n(api: openai.OpenAI) -> None:
    out = api.completions.create(
        model=MODEL_NAME,
        prompt="To be, or not",
        max_tokens=12,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 12 == len(choice.logprobs.tokens)
    assert out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert "".join(choice.logprobs.tokens) == choice.text
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert all(len(top) >= 1 for top in choice.logprobs.top_logprobs)
    many = api.completions.create(
        model=MODEL_NAME,
        prompt=["a", "b c"],
        max_tokens=5,
        n=3,
        seed=1,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in many.choices) == list(range(6))
    assert many.usage.completion_tokens == 30


def test_streaming_completion_equals_non_streaming(api: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, prompt="Friends, Romans", max_tokens=16, temperature=0)
    full = api.completions.create(**kwargs)
    chunks = list(
        api.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices == []
    assert chunks[-1].usage == full.usage


def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(api: openai.OpenAI) -> None:
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries
    its choice's usage so far (chat's opening chunk: the prompt, no completion yet), and the
    last chunk the whole call's, on both endpoints with n = 2."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    calls = [
        (api.completions.create, {"prompt": "Friends, Romans"}),
        (api.chat.completions.create, {"messages": [{"role": "user", "content": "hi"}]}),
    ]
    for create, body in calls:
        settings = dict(model=MODEL_NAME, max_tokens=5, n=2, temperature=0, **body)
        full = create(**settings)
        chunks = list(create(stream=True, stream_options=options, **settings))
        counts: dict[int, list[int]] = {0: [], 1: []}
        for chunk in chunks[:-1]:
            (choice,) = chunk.choices
            assert chunk.usage.prompt_tokens == full.usage.prompt_tokens  # one prompt
            assert (
                chunk.usage.total_tokens
                == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
            )
            counts[choice.index].append(chunk.usage.completion_tokens)
        for seen in counts.values():
            assert seen == sorted(seen) and seen[-1] == 5
        assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    plain = list(api.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, stream=True))
    assert all(chunk.usage is None for chunk in plain)


def test_chat_echo_puts_a_final_assistant_message_before_the_reply(api: openai.OpenAI) -> None:
    """vLLM's chat `echo`: the content of a final assistant message (the one the reply
    continues) comes first, whole and streamed, in every choice; a final user message is not
    echoed."""
    start = "To be, or not"
    continued = [{"role": "user", "content": "Say it"}, {"role": "assistant", "content": start}]
    settings = dict(
        model=MODEL_NAME, max_tokens=6, temperature=0, n=2,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )  # fmt: skip
    plain = api.chat.completions.create(messages=continued, **settings)
    echo = {**settings, "extra_body": {**settings["extra_body"], "echo": True}}
    whole = api.chat.completions.create(messages=continued, **echo)
    for a, b in zip(whole.choices, plain.choices, strict=True):
        assert a.message.content == start + b.message.content
    chunks = list(api.chat.completions.create(messages=continued, stream=True, **echo))
    streamed = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert [streamed[i] for i in (0, 1)] == [c.message.content for c in whole.choices]
    asked = [{"role": "user", "content": "Say it"}]
    user_last = api.chat.completions.create(
        messages=asked, model=MODEL_NAME, max_tokens=6, temperature=0, extra_body={"echo": True}
    )
    alone = api.chat.completions.create(
        messages=asked, model=MODEL_NAME, max_tokens=6, temperature=0
    )
    assert user_last.choices[0].message.content == alone.choices[0].message.content


def test_stop_string_is_not_in_the_output(api: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL_NAME,
        prompt="The slings",
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = api.completions.create(**kwargs).choices[0].text
    stop = pick_stop_string(text)
    stopped = api.completions.create(stop=[stop], **kwargs).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.index(stop)]
    streamed = api.completions.create(stop=[stop], stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in streamed) == stopped.text


def test_chat_completion_streaming_and_not(api: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Who art thou?"}]
    full = api.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    choice = full.choices[0]
    assert choice.message.role == "assistant"
    assert full.usage.completion_tokens == len(choice.logprobs.content)
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    chunks = list(
        api.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_http_zmq_and_offline_agree_with_the_same_seed(server, api, model_path: Path) -> None:
    params = dict(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
    http_text = "".join(
        c.choices[0].text
        for c in api.completions.create(model=MODEL_NAME, prompt="O Romeo", stream=True, **params)
    )
    with Client(server[0].addresses.engine_address) as client:
        zmq_text = "".join(d.text for d in client.generate("O Romeo", SamplingParams(**params)))

    async def async_zmq() -> str:
        async with AsyncClient(server[0].addresses.engine_address) as client:
            return "".join(
                [d.text async for d in client.generate("O Romeo", SamplingParams(**params))]
            )

    async_text = anyio.run(async_zmq)
    with LLM(
        str(model_path), max_model_len=MAX_MODEL_LEN, num_kv_blocks=64, supervision=NO_STANDBY
    ) as llm:
        offline = llm.generate("O Romeo", SamplingParams(**params))[0].outputs[0].text
    assert http_text == zmq_text == async_text == offline
    assert len(http_text) > 0


def test_a_consumer_that_falls_behind_gets_the_waiting_deltas_merged(server) -> None:
    """The async client (the HTTP server's way to the engine) merges the deltas its consumer
    has not taken yet: fewer, larger deltas with the same tokens, text and logprobs, and one
    final delta, last."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)

    async def run(pause_s: float) -> list:
        async with AsyncClient(server[0].addresses.engine_address) as client:
            deltas = []
            async for delta in client.generate("O Romeo", params):
                deltas.append(delta)
                await anyio.sleep(pause_s if len(deltas) == 1 else 0)
            return deltas

    steady, behind = anyio.run(run, 0.0), anyio.run(run, 1.0)
    for deltas in (steady, behind):
        tokens = [t for d in deltas for t in d.token_ids]
        assert len(tokens) == 40
        assert [e.token_id for d in deltas for e in d.logprobs] == tokens
        assert [d.finish_reason is not None for d in deltas] == [False] * (len(deltas) - 1) + [True]
        offsets = itertools.accumulate((len(d.token_ids) for d in deltas[:-1]), initial=0)
        assert [d.token_offset for d in deltas] == list(offsets)
    assert "".join(d.text for d in behind) == "".join(d.text for d in steady)
    assert [t for d in behind for t in d.token_ids] == [t for d in steady for t in d.token_ids]
    assert len(behind) < len(steady) and max(len(d.token_ids) for d in behind) > 1


@pytest.mark.parametrize(
    "body, status",
    [
        ({"model": "nope", "prompt": "x"}, 404),
        ({"model": MODEL_NAME, "prompt": "x", "max_tokens": -1}, 400),
        ({"model": MODEL_NAME, "prompt": [7] * (MAX_MODEL_LEN + 5)}, 400),
        ({"model": MODEL_NAME, "prompt": "x", "temperature": -0.5}, 400),
        ({"model": MODEL_NAME, "prompt": "x", "n": 0}, 400),
        ({"model": MODEL_NAME, "prompt": 12.5}, 400),
        ({"model": MODEL_NAME, "prompt": "x", "max_tokens": "many"}, 400),
        ({"model": MODEL_NAME}, 400),
        ({"model": MODEL_NAME, "prompt": "x", "top_k": 2**63}, 400),
        ({"model": MODEL_NAME, "prompt": "x", "seed": 2**64}, 400),
        ({"model": MODEL_NAME, "prompt": "x", "max_tokens": 2**63}, 400),
        ({"model": MODEL_NAME, "prompt": "x", "min_tokens": -(2**63) - 1}, 400),
        ({"model": MODEL_NAME, "prompt": "x", "min_tokens": 5, "max_tokens": 4}, 400),
        ({"model": MODEL_NAME, "prompt": "x", "stop_token_ids": [2**70]}, 400),
        ({"model": MODEL_NAME, "prompt": [[], [], [4096]]}, 400),
        ({"model": MODEL_NAME, "prompt": [[1], [2], [4096]]}, 400),
        ({"model": MODEL_NAME, "prompt": [5, -1]}, 400),
        ({"model": MODEL_NAME, "prompt": "x", "n": 17}, 400),
        ({"model": MODEL_NAME, "prompt": "x", "n": 2, "seed": 2**63 - 1}, 400),
        ({"model": MODEL_NAME, "prompt": "x", "n": 1e30}, 400),
        ({"model": MODEL_NAME, "prompt": "x", "n": 10**6, "best_of": 10**6}, 400),
        ({"model": MODEL_NAME, "prompt": "x", "stop": ["a"] * 9}, 400),
        ({"model": MODEL_NAME, "prompt": "x", "stop": "y" * 33}, 400),
        ({"model": MODEL_NAME, "prompt": "x", "stop_token_ids": [1] * 9}, 400),
        ({"model": MODEL_NAME, "prompt": "x" * 50_001}, 400),
        ({"model": MODEL_NAME, "prompt": ["x"] * 65}, 400),
        ({"model": MODEL_NAME, "prompt": "x", "logprobs": 21}, 400),
        ({"model": MODEL_NAME, "prompt": "x", "unknown": [[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]}, 400),
    ],
)
def test_bad_input_is_an_openai_4xx_and_the_engine_keeps_serving(server, body, status) -> None:
    response = httpx.post(server[1] + "/v1/completions", json=body)
    assert response.status_code == status
    assert set(response.json()["error"]) >= {"message", "type", "code"}
    ok = httpx.post(
        server[1] + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
    )
    assert ok.status_code == 200


def test_malformed_json_and_bad_chat_are_400(server) -> None:
    bad = httpx.post(
        server[1] + "/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert bad.status_code == 400
    chat = httpx.post(
        server[1] + "/v1/chat/completions", json={"model": MODEL_NAME, "messages": "hello"}
    )
    assert chat.status_code == 400


async def test_many_streams_with_disconnects_free_every_block(server) -> None:
    base = server[1]
    done: list[str] = []

    async def one(client: openai.AsyncOpenAI, i: int) -> None:
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=f"request {i}",
            max_tokens=24,
            stream=True,
            temperature=1.0,
            seed=i,
            extra_body={"ignore_eos": True},
        )
        count = 0
        async for chunk in stream:
            count += 1
            if i % 4 == 0 and count == 2:  # 50 of 200 walk away mid-stream
                await stream.close()
                return
            if chunk.choices[0].finish_reason is not None:
                done.append(chunk.choices[0].finish_reason)

    async with openai.AsyncOpenAI(
        base_url=base + "/v1",
        api_key="x",
        max_retries=0,
        timeout=120,
        http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=300)),
    ) as client:
        async with anyio.create_task_group() as tg:
            for i in range(200):
                tg.start_soon(one, client, i)
    assert done == ["length"] * 150
    async with httpx.AsyncClient() as http:
        for _ in range(50):
            text = (await http.get(base + "/metrics")).text
            if metric(text, "pagedserve:kv_cache_free_blocks") == 512:
                break
            await anyio.sleep(0.1)
    assert metric(text, "pagedserve:kv_cache_free_blocks") == 512
    assert metric(text, "pagedserve:num_requests_running") == 0
    assert metric(text, "pagedserve:generation_tokens_total") >= 150 * 24
    assert metric(text, "pagedserve:prompt_tokens_total") > 0
    assert metric(text, 'pagedserve:request_success_total{finished_reason="length"}') >= 150
    assert metric(text, "pagedserve:time_to_first_token_seconds_count") >= 150
    await assert_the_server_client_holds_nothing(base)


async def assert_the_server_client_holds_nothing(base: str) -> None:
    """The API server's engine client keeps nothing of finished or abandoned requests: its
    queue depths (from its heartbeats, in /metrics, which has none before the first) go back
    to 0."""
    names = [f'pagedserve:actor_queue_depth{{actor="api-server",queue="{q}"}}'
             for q in ("requests", "streams")]  # fmt: skip
    async with httpx.AsyncClient() as http:
        for _ in range(60):  # a heartbeat a second; one may be taken while /metrics waits
            text = (await http.get(base + "/metrics")).text
            depths = [metric(text, name, default=-1.0) for name in names]
            if depths == [0, 0]:
                return
            await anyio.sleep(0.1)
    assert depths == [0, 0]


def test_api_key_and_restart_of_dead_stateless_actors(model_path: Path) -> None:
    port = free_port()
    config = EngineConfig(
        model=str(model_path), num_kv_blocks=32, server=ServerConfig(port=port, api_key="sekrit")
    )
    supervisor = Supervisor(config)
    supervisor.start(extra_actors=("api-server",))
    base = f"http://127.0.0.1:{port}/v1"
    good = openai.OpenAI(base_url=base, api_key="sekrit", max_retries=0)
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).completions.create(
                model=str(model_path), prompt="x", max_tokens=2
            )
        assert (
            len(good.completions.create(model=str(model_path), prompt="x", max_tokens=2).choices)
            == 1
        )
        check_api_key_guards(port, "sekrit")
        for name in ("api-server", "tokenizer"):
            supervisor.processes[name].kill()
        deadline = time.monotonic() + 120
        while True:  # the supervisor brings both back
            try:
                reply = good.completions.create(model=str(model_path), prompt="x", max_tokens=2)
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the server did not come back"
                time.sleep(0.1)
        assert len(reply.choices) == 1
        assert supervisor.restarts == {"api-server": 1, "tokenizer": 1}
        assert supervisor.dead_reason is None
    finally:
        supervisor.stop()


def check_api_key_guards(port: int, key: str) -> None:
    """Every route but /health, /ping, /metrics and /version needs the key, which is checked before
    the body is read (a 401 comes back while the declared body has not been sent)."""
    base = f"http://127.0.0.1:{port}"
    for path in ("/v1/models", f"/v1/models/{MODEL_NAME}", "/tokenize", "/v1/completions"):
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": key}):
            response = httpx.request(
                "GET" if "models" in path else "POST", base + path, headers=headers
            )
            assert response.status_code == 401, path
            assert response.json()["error"]["code"] == "invalid_api_key"
    for path in ("/health", "/ping", "/metrics", "/version"):
        assert httpx.get(base + path).status_code == 200
    assert httpx.get(base + "/v1/models", headers={"authorization": f"Bearer {key}"}).is_success
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000\r\nAuthorization: Bearer wrong\r\n\r\n"
        )
        assert sock.recv(4096).startswith(b"HTTP/1.1 401")


def test_echo_penalties_and_user_fields(api: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, prompt="To be, or not", max_tokens=8, temperature=0, user="u1")
    plain = api.completions.create(**kwargs).choices[0].text
    echoed = api.completions.create(echo=True, **kwargs).choices[0].text
    assert echoed == "To be, or not" + plain
    long = {**kwargs, "max_tokens": 48, "logprobs": 0}
    free = api.completions.create(**long).choices[0].logprobs.tokens
    penalties = dict(frequency_penalty=2.0, presence_penalty=2.0)
    penalised = (
        api.completions.create(extra_body={"repetition_penalty": 1.5}, **penalties, **long)
        .choices[0]
        .logprobs.tokens
    )
    assert len(set(free)) < len(free)  # greedy on this model repeats itself...
    assert len(set(penalised)) > len(set(free))  # ...and the penalties reach the sampler


def test_streams_with_several_choices_end_with_done(server, api: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL_NAME,
        prompt=["To be", "Friends, Romans"],
        max_tokens=8,
        n=3,
        seed=7,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    full = api.completions.create(**kwargs)
    chunks = list(
        api.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    streamed: dict[int, str] = collections.defaultdict(str)
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == {c.index: c.text for c in full.choices}
    assert len(streamed) == 6
    assert chunks[-1].usage == full.usage
    chat = list(
        api.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Who art thou?"}],
            n=2,
            max_tokens=6,
            seed=3,
            stream=True,
        )
    )
    finished = [c.index for chunk in chat for c in chunk.choices if c.finish_reason]
    assert sorted(finished) == [0, 1]
    raw = httpx.post(
        server[1] + "/v1/completions",
        json={"model": MODEL_NAME, "prompt": ["a", "b"], "n": 2, "max_tokens": 4, "stream": True},
    )
    assert raw.status_code == 200 and raw.text.endswith("data: [DONE]\n\n")


def test_completion_top_logprobs_include_the_sampled_token(api: openai.OpenAI) -> None:
    out = api.completions.create(
        model=MODEL_NAME,
        prompt="O Romeo",
        max_tokens=32,
        temperature=1.5,
        seed=5,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    logprobs = out.choices[0].logprobs
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert token in top
        if "\ufffd" not in token:  # pieces of one character all read as U+FFFD: keys collide
            assert top[token] == logprob
    assert any(len(top) == 2 for top in logprobs.top_logprobs)  # sampled, not the most likely


async def test_a_client_that_leaves_a_whole_response_aborts_it(server) -> None:
    supervisor, base = server
    body = {"model": MODEL_NAME, "prompt": "x", "n": 4, "max_tokens": 240, "ignore_eos": True}
    async with AsyncClient(supervisor.addresses.engine_address) as engine:
        before = await engine.stats()
        aborted_before = metric(
            httpx.get(base + "/metrics").text,
            'pagedserve:request_success_total{finished_reason="abort"}',
            default=0.0,
        )
        async with httpx.AsyncClient(timeout=60) as http, anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(http.post, base + "/v1/completions", json=body))
            with anyio.fail_after(30):
                while (await engine.stats()).num_running < 4:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()  # the client hangs up before the response
        with anyio.fail_after(5):
            while (stats := await engine.stats()).num_running:
                await anyio.sleep(0.02)
    assert stats.num_generation_tokens - before.num_generation_tokens < 4 * 240 // 2
    aborted = metric(
        httpx.get(base + "/metrics").text,
        'pagedserve:request_success_total{finished_reason="abort"}',
    )
    assert aborted == aborted_before + 4
    await assert_the_server_client_holds_nothing(base)


def test_model_tokenize_detokenize_and_version_endpoints(server, api: openai.OpenAI) -> None:
    base = server[1]
    assert api.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("nope")
    prompt = "To be, or not"
    tokens = httpx.post(
        base + "/tokenize", json={"model": MODEL_NAME, "prompt": prompt, "return_token_strs": True}
    ).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) > 0
    assert tokens["max_model_len"] == MAX_MODEL_LEN
    usage = api.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1).usage
    assert usage.prompt_tokens == tokens["count"]
    text = httpx.post(base + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": prompt}
    messages = [{"role": "user", "content": "Who art thou?"}]
    chat_tokens = httpx.post(base + "/tokenize", json={"messages": messages}).json()
    chat = api.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == chat_tokens["count"]
    assert httpx.get(base + "/version").json() == {"version": pagedserve.__version__}
    for response, status in (
        (httpx.get(base + "/nope"), 404),
        (httpx.get(base + "/tokenize"), 405),
    ):
        assert response.status_code == status
        assert set(response.json()["error"]) >= {"message", "type", "code"}
    bad = httpx.post(base + "/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400


@pytest.mark.parametrize(
    "path, fields",
    [
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
        ("/v1/chat/completions", {"tool_choice": "required"}),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {}}}),
        ("/v1/completions", {"best_of": 3}),
        ("/v1/completions", {"suffix": "The end."}),
        # vLLM's extra fields that would change the output
        ("/v1/completions", {"length_penalty": 0.5}),
        ("/v1/completions", {"priority": 1}),
        ("/v1/chat/completions", {"logits_processors": ["a.b"]}),
        ("/v1/completions", {"guided_whitespace_pattern": " "}),
        ("/v1/completions", {"prompt_embeds": "AAAA"}),
        ("/v1/chat/completions", {"documents": [{"text": "x"}]}),
    ],
)
def test_fields_that_are_not_implemented_are_a_400(server, path: str, fields: dict) -> None:
    name = next(iter(fields))
    response = httpx.post(server[1] + path, json={**minimal_body(path), **fields})
    assert response.status_code == 400
    assert name.split("_")[0] in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "path, fields",
    [
        ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "none"}),
        ("/v1/chat/completions", {"response_format": {"type": "text"}}),
        ("/v1/completions", {"best_of": 2, "n": 2}),
        ("/v1/completions", {"logit_bias": {}, "suffix": ""}),
    ],
)
def test_fields_that_change_nothing_are_accepted(server, path: str, fields: dict) -> None:
    assert httpx.post(server[1] + path, json={**minimal_body(path), **fields}).status_code == 200


def test_logit_bias_steers_the_tokens_and_bad_keys_are_a_400(server, api: openai.OpenAI) -> None:
    """OpenAI's logit_bias (token id as text -> bias, clamped to [-100, 100]): a bias of 100
    (here 500) makes one token every greedy pick, on both endpoints; a key that is no token
    id, or an id outside the vocabulary, is a 400."""
    base = server[1]
    token = httpx.post(base + "/tokenize", json={"prompt": " the"}).json()["tokens"][-1]
    expected = httpx.post(base + "/detokenize", json={"tokens": [token] * 5}).json()["prompt"]
    settings = {"max_tokens": 5, "temperature": 0, "logit_bias": {str(token): 500}}
    completion = api.completions.create(model=MODEL_NAME, prompt="To be", **settings)
    assert completion.choices[0].text == expected
    chat = api.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], **settings
    )
    assert chat.choices[0].message.content == expected
    for bias in ({"the": 1}, {"-3": 1}, {"1000000": 1}):
        body = {**minimal_body("/v1/completions"), "logit_bias": bias}
        response = httpx.post(base + "/v1/completions", json=body)
        assert response.status_code == 400
        assert "logit_bias" in response.json()["error"]["message"]


def test_bad_words_keep_a_word_out_on_both_endpoints(server, api: openai.OpenAI) -> None:
    """vLLM's bad_words: a word greedy decoding writes first is not written with it, on both
    endpoints; more words than the server's limit are a 400."""
    base = server[1]
    for path, body in [
        ("/v1/completions", {"prompt": "To be"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ]:
        settings = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0, **body}
        free = httpx.post(base + path, json={**settings, "return_token_ids": True}).json()
        token, word = next(
            (t, text)
            for t in free["choices"][0]["token_ids"]
            if (text := httpx.post(base + "/detokenize", json={"tokens": [t]}).json()["prompt"])
            == text.strip()
            and httpx.post(base + "/tokenize", json={"prompt": text}).json()["tokens"] == [t]
        )
        banned = httpx.post(
            base + path, json={**settings, "return_token_ids": True, "bad_words": [word]}
        )
        assert banned.status_code == 200
        tokens = banned.json()["choices"][0]["token_ids"]
        assert len(tokens) == 6 and token not in tokens
    too_many = {**minimal_body("/v1/completions"), "bad_words": ["a"] * 65}
    response = httpx.post(base + "/v1/completions", json=too_many)
    assert response.status_code == 400 and "bad_words" in response.json()["error"]["message"]


def test_chat_template_fields_reach_the_template(server, api: openai.OpenAI) -> None:
    """vLLM's add_generation_prompt (it was ignored), continue_final_message and
    chat_template_kwargs: the engine's prompt is what /tokenize renders with the same fields;
    both flags at once, or a kwarg that is apply_chat_template's own, is a 400."""
    base = server[1]
    user = [{"role": "user", "content": "Who art thou?"}]
    opening = [*user, {"role": "assistant", "content": "I am the"}]
    cases = [
        (user, {}),
        (user, {"add_generation_prompt": False}),
        (opening, {"add_generation_prompt": False, "continue_final_message": True}),
        (user, {"chat_template_kwargs": {"enable_thinking": False}}),  # a variable it ignores
    ]
    prompts = []
    for messages, fields in cases:
        expected = httpx.post(base + "/tokenize", json={"messages": messages, **fields}).json()
        chat = api.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=2,
            extra_body={**fields, "return_token_ids": True},
        )  # fmt: skip
        assert chat.model_extra["prompt_token_ids"] == expected["tokens"]
        prompts.append(expected["tokens"])
    assert prompts[0][: len(prompts[1])] == prompts[1] and len(prompts[0]) > len(prompts[1])
    text = httpx.post(base + "/detokenize", json={"tokens": prompts[2]}).json()["prompt"]
    assert text.endswith("I am the") and prompts[3] == prompts[0]
    for fields in ({"continue_final_message": True}, {"chat_template_kwargs": {"tokenize": 1}}):
        body = {**minimal_body("/v1/chat/completions"), **fields}
        for path in ("/v1/chat/completions", "/tokenize"):
            response = httpx.post(base + path, json=body)
            assert response.status_code == 400, (path, fields)


def test_reasoning_effort_is_a_chat_template_variable(server, api: openai.OpenAI) -> None:
    """OpenAI's reasoning_effort reaches the chat template as `reasoning_effort` (GPT-OSS's
    template reads it; this model's ignores it), under a chat_template_kwargs of the same name;
    a value OpenAI does not define is a 400."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "low"}
    options = msgspec.convert(body, ChatCompletionRequest).prompt_options()
    assert options.chat_template_kwargs == {"reasoning_effort": "low"}
    both = {**body, "chat_template_kwargs": {"reasoning_effort": "high", "x": 1}}
    options = msgspec.convert(both, ChatCompletionRequest).prompt_options()
    assert options.chat_template_kwargs == {"reasoning_effort": "high", "x": 1}
    chat = api.chat.completions.create(
        model=MODEL_NAME, messages=body["messages"], max_tokens=2, reasoning_effort="low"
    )
    assert chat.choices[0].message.content is not None
    bad = {**minimal_body("/v1/chat/completions"), "reasoning_effort": "extreme"}
    response = httpx.post(server[1] + "/v1/chat/completions", json=bad)
    assert response.status_code == 400 and "reasoning_effort" in response.text


def test_vllm_token_fields_on_both_endpoints(server, api: openai.OpenAI) -> None:
    """allowed_token_ids (only those sampled), truncate_prompt_tokens (the prompt's last k
    tokens; -1: what leaves room for one output token), return_token_ids (the prompt's and
    each choice's ids, streamed too) and return_tokens_as_token_ids ("token_id:{id}" in the
    logprobs)."""
    base = server[1]
    ids = httpx.post(base + "/tokenize", json={"prompt": "To be, or not to be"}).json()["tokens"]
    greedy = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0}
    with_ids = {"return_token_ids": True}
    allowed = ids[-3:]
    out = api.completions.create(
        prompt="To be", **{**greedy, "temperature": 1.0}, n=3, seed=2,
        extra_body={"allowed_token_ids": allowed, **with_ids},
    )  # fmt: skip
    assert all(set(c.model_extra["token_ids"]) <= set(allowed) for c in out.choices)
    cut = api.completions.create(
        prompt="To be, or not to be", **greedy,
        extra_body={"truncate_prompt_tokens": 3, **with_ids},
    )  # fmt: skip
    tail = api.completions.create(prompt=ids[-3:], **greedy)
    assert cut.choices[0].model_extra["prompt_token_ids"] == ids[-3:]
    assert cut.choices[0].text == tail.choices[0].text and cut.usage.prompt_tokens == 3
    long = api.completions.create(
        prompt="to be " * MAX_MODEL_LEN, **greedy, extra_body={"truncate_prompt_tokens": -1}
    )
    assert long.usage.prompt_tokens == MAX_MODEL_LEN - 1 and long.usage.completion_tokens == 1
    for bad in (0, -2):
        body = {**minimal_body("/v1/completions"), "truncate_prompt_tokens": bad}
        assert httpx.post(base + "/v1/completions", json=body).status_code == 400
    as_ids = {"return_tokens_as_token_ids": True, **with_ids}
    scored = api.completions.create(prompt="To be", logprobs=1, **greedy, extra_body=as_ids)
    choice = scored.choices[0]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.model_extra["token_ids"]]
    messages = [{"role": "user", "content": "Who art thou?"}]
    chat = api.chat.completions.create(
        messages=messages, logprobs=True, **greedy, extra_body=as_ids
    )
    token_ids = chat.choices[0].model_extra["token_ids"]
    named = [entry.token for entry in chat.choices[0].logprobs.content]
    assert named == [f"token_id:{t}" for t in token_ids]
    chunks = list(
        api.chat.completions.create(messages=messages, stream=True, **greedy, extra_body=with_ids)
    )
    streamed = [
        t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids", [])
    ]
    prompts = [
        c.model_extra["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c.model_extra
    ]
    assert streamed == token_ids and prompts == [chat.model_extra["prompt_token_ids"]]


def test_beam_search_on_both_endpoints(server, api: openai.OpenAI, model_path: Path) -> None:
    """use_beam_search (vLLM's, n beams): a completion's choices are the n best beams of the
    plain search over transformers' logits, best first, whole and streamed, with logprobs of
    the chosen tokens; chat answers n beams; what a beam search cannot follow is a 400."""
    prompt = [5, 17, 99, 3, 42]
    beams = {"use_beam_search": True, "length_penalty": 0.7, "return_token_ids": True}
    fields = {"model": MODEL_NAME, "max_tokens": 5, "temperature": 0, "n": 3}
    out = api.completions.create(prompt=prompt, logprobs=2, **fields, extra_body=beams)
    eos = {0}  # the tiny tokenizer's <|endoftext|>, its generation config's EOS
    expected = hf_beam_search(load_hf_model(model_path), prompt, 3, 5, eos, length_penalty=0.7)
    assert [c.model_extra["token_ids"] for c in out.choices] == [t[5:] for t, _ in expected]
    for choice, (_, cum) in zip(out.choices, expected):
        assert sum(choice.logprobs.token_logprobs) == pytest.approx(cum, abs=1e-3)
        assert len(choice.logprobs.top_logprobs) == len(choice.model_extra["token_ids"])
    assert out.usage.completion_tokens == sum(len(t) - 5 for t, _ in expected)
    chunks = list(api.completions.create(prompt=prompt, stream=True, **fields, extra_body=beams))
    streamed = {c.choices[0].index: c.choices[0].text for c in chunks if c.choices}
    assert [streamed[i] for i in range(3)] == [c.text for c in out.choices]
    chat = api.chat.completions.create(messages=ASK, **fields, extra_body=beams)
    assert len(chat.choices) == 3
    assert len({tuple(c.model_extra["token_ids"]) for c in chat.choices}) == 3
    for extra in ({"stop": ["the"]}, {"top_p": 0.5}, {"min_tokens": 2}, {"prompt_logprobs": 1}):
        body = {**minimal_body("/v1/completions"), **fields, "use_beam_search": True, **extra}
        response = httpx.post(server[1] + "/v1/completions", json=body)
        assert response.status_code == 400
        assert next(iter(extra)) in response.json()["error"]["message"]


def streamed_calls(chunks: list) -> tuple[list[dict], str | None]:
    """The tool calls a stream spelled out (by index: id, name, arguments joined), and its
    finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = delta.id or call["id"]
                call["name"] = delta.function.name or call["name"]
                call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


def test_named_and_required_tool_choice_give_tool_calls(server, api: openai.OpenAI) -> None:
    """Tool calling as vLLM answers it without a parser: a named tool_choice constrains the
    reply to that function's arguments, "required" to a JSON array of calls; both come back
    as tool_calls (content None), whole or streamed (a named call's arguments as they come, its
    id and name first). "required" finishes with "tool_calls", a named call with "stop"."""
    named = {"type": "function", "function": {"name": "weather"}}
    settings = {"model": MODEL_NAME, "messages": ASK, "tools": TOOLS, "temperature": 0}
    whole = api.chat.completions.create(tool_choice=named, max_tokens=40, **settings)
    choice = whole.choices[0]
    assert choice.message.content is None and choice.finish_reason == "stop"
    (call,) = choice.message.tool_calls
    assert call.function.name == "weather" and call.id.startswith("chatcmpl-tool-")
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    chunks = list(
        api.chat.completions.create(tool_choice=named, max_tokens=40, stream=True, **settings)
    )
    calls, finish = streamed_calls(chunks)
    assert finish == "stop" and len(calls) == 1 and calls[0]["id"]
    assert (calls[0]["name"], calls[0]["arguments"]) == ("weather", call.function.arguments)
    # the greedy array would go on; the bias on "]" ends it after the first call
    close = httpx.post(server[1] + "/tokenize", json={"prompt": "]", "add_special_tokens": False})
    bias = {str(close.json()["tokens"][-1]): 50}
    required = {**settings, "tool_choice": "required", "max_tokens": 60, "logit_bias": bias}
    whole = api.chat.completions.create(**required)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    names = {tool["function"]["name"]: tool for tool in TOOLS}
    for call in choice.message.tool_calls:
        (key,) = names[call.function.name]["function"]["parameters"]["required"]
        assert set(json.loads(call.function.arguments)) == {key}
    calls, finish = streamed_calls(list(api.chat.completions.create(stream=True, **required)))
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]


def test_tool_choices_that_cannot_be_answered_are_a_400(server, api: openai.OpenAI) -> None:
    """ "auto" (also the default with tools) needs a tool-call parser; a named function must be
    among the tools; a choice needs tools and excludes other constraints. "none" answers in
    content, and earlier calls and their results are accepted in the messages."""
    base = server[1] + "/v1/chat/completions"
    body = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 3}
    for fields in (
        {"tools": TOOLS},
        {"tools": TOOLS, "tool_choice": "auto"},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": TOOLS, "tool_choice": "any"},
        {"tool_choice": "required"},
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        {"tools": [{"type": "retrieval", "function": {"name": "r"}}], "tool_choice": "required"},
    ):
        response = httpx.post(base, json={**body, **fields})
        assert response.status_code == 400, fields
        assert "tool" in response.json()["error"]["message"]
    called = {"name": "weather", "arguments": '{"city": "Paris"}'}
    turns = [
        *ASK,
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": called}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    reply = api.chat.completions.create(model=MODEL_NAME, messages=turns, tools=TOOLS,
                                        tool_choice="none", max_tokens=3)  # fmt: skip
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls


def test_echo_with_max_tokens_0_scores_the_prompt_only(api: openai.OpenAI) -> None:
    """vLLM's (and the legacy OpenAI API's) way to score a text: echo, max_tokens 0 and
    logprobs give the prompt and its logprobs, no completion tokens; streamed the same."""
    settings = {"model": MODEL_NAME, "prompt": "To be, or not", "max_tokens": 0, "echo": True}
    whole = api.completions.create(logprobs=1, **settings)
    choice = whole.choices[0]
    assert choice.text == "To be, or not" and whole.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == whole.usage.prompt_tokens
    scores = choice.logprobs.token_logprobs
    assert scores[0] is None and None not in scores[1:]
    chunks = list(
        api.completions.create(
            logprobs=1, stream=True, stream_options={"include_usage": True}, **settings
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "To be, or not"
    logprobs = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for entry in logprobs for t in entry.tokens] == choice.logprobs.tokens
    assert chunks[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        api.completions.create(model=MODEL_NAME, prompt="To be", max_tokens=0)


def minimal_body(path: str) -> dict:
    if path == "/v1/completions":
        return {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


def test_a_body_must_be_json_within_the_size_and_depth_limits(server) -> None:
    base = server[1]
    hostile = json.dumps({"model": MODEL_NAME, "prompt": "a", "max_tokens": 3, "top_k": 2**63})
    for path in ("/v1/completions", "/v1/chat/completions"):
        for headers in ({"content-type": "text/plain"}, {}):
            response = httpx.post(base + path, content=hostile, headers=headers)
            assert response.status_code == 415
        assert httpx.post(base + path, json=json.loads(hostile)).status_code == 400
    large = httpx.post(base + "/v1/completions", json={"prompt": "x" * (1 << 20)})
    assert large.status_code == 413
    deep = b'{"prompt": "a", "junk": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = httpx.post(
        base + "/v1/completions", content=deep, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "nests" in response.json()["error"]["message"]
    for number in (b"1e999", b"-1e999"):  # JSON numbers no float holds
        response = httpx.post(
            base + "/v1/completions",
            content=b'{"prompt": "a", "temperature": %s}' % number,
            headers={"content-type": "application/json"},
        )
        assert response.status_code == 400
    brackets = {"model": MODEL_NAME, "prompt": "[{" * 40, "max_tokens": 2}  # in a string
    assert httpx.post(base + "/v1/completions", json=brackets).status_code == 200


def test_responses_are_not_held_back_by_nagles_algorithm(server) -> None:
    """A response's headers and body go out in two writes: without TCP_NODELAY each waits for
    the client's delayed ACK (40 ms), so 20 small requests would take 0.8 s or more."""
    with httpx.Client(base_url=server[1]) as http:
        http.get("/version")
        start = time.perf_counter()
        for _ in range(20):
            assert http.get("/version").status_code == 200
        assert time.perf_counter() - start < 0.6
