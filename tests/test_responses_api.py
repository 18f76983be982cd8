"""The stateless Responses API, `POST /v1/responses`, driven by the official `openai` client
against a real server: the same text as the chat completion it maps onto, whole or streamed,
and a 400 for everything it does not follow."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx2 as httpx
import openai
import pytest

from pagedserve.api.responses_api import ResponsesRequest
from pagedserve.config import EngineConfig, ServerConfig
from tests.engine_settings import NO_STANDBY
from tests.test_openai_server import LIMITS, free_port, metric, running_server
from tests.tiny_models import save_tiny_model

MODEL_NAME = "tiny"
STREAM_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_path: Path = save_tiny_model("llama", tmp_path_factory.mktemp("responses"))
    port = free_port()
    config = EngineConfig(
        model=str(model_path),
        max_model_len=256,
        num_kv_blocks=256,
        server=ServerConfig(port=port, served_model_name=MODEL_NAME, **LIMITS),
        supervision=NO_STANDBY,
    )
    with running_server(config) as base:
        yield base


@pytest.fixture
def api(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


def chat_text(api: openai.OpenAI, messages: list[dict], max_tokens: int) -> str:
    out = api.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0
    )
    return out.choices[0].message.content or ""


def test_a_text_input_answers_as_its_chat_completion(api: openai.OpenAI) -> None:
    out = api.responses.create(
        model=MODEL_NAME, input="To be, or not", max_output_tokens=8, temperature=0,
        metadata={"k": "v"}, store=False,
    )  # fmt: skip
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output_text == chat_text(api, [{"role": "user", "content": "To be, or not"}], 8)
    message = out.output[0]
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.content[0].annotations == []
    assert out.usage.output_tokens == 8 and out.usage.input_tokens > 0
    assert out.usage.total_tokens == out.usage.input_tokens + 8
    assert out.usage.input_tokens_details.cached_tokens >= 0
    assert out.usage.output_tokens_details.reasoning_tokens == 0
    assert out.metadata == {"k": "v"} and out.temperature == 0 and out.tools == []


def test_instructions_and_message_items_are_the_chat_messages(api: openai.OpenAI) -> None:
    out = api.responses.create(
        model=MODEL_NAME,
        instructions="Speak as Hamlet.",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Who is "}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "A prince."}]},
            {"type": "message", "role": "developer", "content": "Say more."},
        ],
        max_output_tokens=6,
        temperature=0,
    )
    messages = [
        {"role": "system", "content": "Speak as Hamlet."},
        {"role": "user", "content": "Who is "},
        {"role": "assistant", "content": "A prince."},
        {"role": "system", "content": "Say more."},
    ]
    assert out.instructions == "Speak as Hamlet."
    assert out.output_text == chat_text(api, messages, 6)


def test_a_reply_that_ends_before_the_limit_is_completed(api: openai.OpenAI) -> None:
    out = api.responses.create(
        model=MODEL_NAME, input="ROMEO:", max_output_tokens=200, temperature=0,
        extra_body={"text": {"format": {"type": "text"}}},
    )  # fmt: skip
    if out.usage.output_tokens < 200:  # the tiny model stopped by itself
        assert out.status == "completed" and out.incomplete_details is None
    assert out.output[0].status == out.status


def test_streaming_gives_the_events_in_order_and_the_same_text(api: openai.OpenAI) -> None:
    whole = api.responses.create(
        model=MODEL_NAME, input="To be, or not", max_output_tokens=8, temperature=0
    )
    events = list(
        api.responses.create(
            model=MODEL_NAME, input="To be, or not", max_output_tokens=8, temperature=0,
            stream=True,
        )
    )  # fmt: skip
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert 1 <= deltas <= 8
    expected = STREAM_EVENTS[:5] + ["response.output_text.delta"] * (deltas - 1)
    assert kinds == expected + STREAM_EVENTS[5:] + ["response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text == events[5 + deltas - 1].text
    final = events[-1].response
    assert (
        final.status == "incomplete"
        and final.output_text == text
        and final.usage.output_tokens == 8
    )
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"


def test_a_completed_stream_ends_with_response_completed(api: openai.OpenAI) -> None:
    with api.responses.stream(model=MODEL_NAME, input="ROMEO:", max_output_tokens=200) as stream:
        final = stream.get_final_response()
    assert final.output_text and final.output[0].status == final.status
    if final.usage.output_tokens < 200:
        assert final.status == "completed"


@pytest.mark.parametrize(
    "fields",
    [
        {"previous_response_id": "resp_123"},
        {"tools": [{"type": "function", "name": "f", "parameters": {}}]},
        {"tool_choice": "required"},
        {"input": 5},
        {"input": []},
        {"input": [{"role": "tool", "content": "x"}]},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
        {"input": [{"type": "item_reference", "role": "user", "content": "x"}]},
        {"input": "x" * 50_001},
        {"max_output_tokens": 0},
        {"max_output_tokens": -1},
        {"max_output_tokens": 2**64},
        {"temperature": "hot"},
        {"text": {"format": {"type": "grammar"}}},
        {"text": {"format": {"type": "json_schema", "name": "x"}}},
        {"metadata": {"k": 1}},
        {"reasoning": {"effort": "extreme"}},
    ],
)
def test_what_it_does_not_follow_is_a_400(server: str, fields: dict) -> None:
    body = {"model": MODEL_NAME, "input": "To be", "max_output_tokens": 2} | fields
    for stream in (False, True):
        reply = httpx.post(server + "/v1/responses", json=body | {"stream": stream}, timeout=30)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["type"] == "invalid_request_error"


def test_reasoning_effort_reaches_the_chat_template(api: openai.OpenAI) -> None:
    """reasoning.effort is the chat's reasoning_effort: a chat template variable (GPT-OSS's)."""
    request = ResponsesRequest(input="To be", reasoning={"effort": "high", "summary": "auto"})
    options = request.to_chat().prompt_options()
    assert options.chat_template_kwargs == {"reasoning_effort": "high"}
    response = api.responses.create(
        model=MODEL_NAME, input="To be", max_output_tokens=2, reasoning={"effort": "low"}
    )
    assert response.status == "incomplete" and response.reasoning.effort == "low"


def test_an_unknown_model_is_a_404_and_json_schema_is_followed(server: str) -> None:
    body = {"model": "nope", "input": "To be"}
    assert httpx.post(server + "/v1/responses", json=body, timeout=30).status_code == 404
    schema = {"type": "string", "enum": ["yes", "no"]}
    text = {"format": {"type": "json_schema", "name": "answer", "schema": schema}}
    body = {"model": MODEL_NAME, "input": "Yes?", "text": text, "max_output_tokens": 8}
    reply = httpx.post(server + "/v1/responses", json=body, timeout=30).json()
    assert reply["output"][0]["content"][0]["text"] in ('"yes"', '"no"')
    assert reply["text"]["format"]["name"] == "answer"


async def test_a_client_that_leaves_a_stream_aborts_it(server: str) -> None:
    body = {"model": MODEL_NAME, "input": "x", "max_output_tokens": 240, "stream": True}
    async with httpx.AsyncClient(base_url=server, timeout=30) as http:
        async with http.stream("POST", "/v1/responses", json=body) as reply:
            async for line in reply.aiter_lines():
                if line == "event: response.output_text.delta":
                    break  # hangs up mid-stream
        with anyio.fail_after(10):
            while running(await http.get("/metrics")):
                await anyio.sleep(0.05)
        aborted = 'pagedserve:request_success_total{finished_reason="abort"}'
        assert metric((await http.get("/metrics")).text, aborted) >= 1


def running(reply: httpx.Response) -> float:
    return metric(reply.text, "pagedserve:num_requests_running")
