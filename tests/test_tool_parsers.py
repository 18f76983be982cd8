"""vLLM's `hermes` tool-call parser for "auto" tool choice: calls in the reply's text, whole or
as the text streams in; and through the chat endpoint (the app in-process, against an engine
stand-in that replies with a scripted text in pieces), with and without
--enable-auto-tool-choice."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from pagedserve.actors.chat import load_tokenizer
from pagedserve.actors.messages import FinishReason, PromptOptions, RequestDelta, SamplingParams
from pagedserve.api.client_core import Prompt
from pagedserve.api.openai_server import OpenAIServer, build_app
from pagedserve.api.tool_parsers import ToolCallStream, parse_tool_calls
from pagedserve.config import EngineConfig, ServerConfig
from tests.tiny_models import save_tiny_model

WEATHER = '{"name": "weather", "arguments": {"city": "Paris", "note": "très beau"}}'
CLOCK = '{"name": "clock", "arguments": {"zone": "CET"}}'
REPLY = f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{CLOCK}</tool_call>"


def calls_of(calls: list[dict]) -> list[tuple[int, str, dict]]:
    return [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls]  # fmt: skip


def test_whole_replies() -> None:
    """Content before the first block; each block a call (arguments as JSON text); a block
    the reply leaves open is read if it is JSON, else it stays content; no tag: content."""
    content, calls = parse_tool_calls(REPLY)
    assert content == "Let me look.\n"
    assert calls_of(calls) == [
        (0, "weather", {"city": "Paris", "note": "très beau"}),
        (1, "clock", {"zone": "CET"}),
    ]
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    assert calls_of(parse_tool_calls(f"<tool_call>{CLOCK}")[1]) == [(0, "clock", {"zone": "CET"})]
    assert parse_tool_calls('<tool_call>{"name": "clock", "argu') == (
        '<tool_call>{"name": "clock", "argu', [],
    )  # fmt: skip
    assert parse_tool_calls("a < b, <tool_ <tool") == ("a < b, <tool_ <tool", [])
    assert parse_tool_calls("") == (None, [])


@pytest.mark.parametrize("seed", range(6))
def test_streamed_pieces_give_what_the_whole_reply_gives(seed: int) -> None:
    """The reply fed in random pieces (one character each for seed 0): the content joined and
    the calls are the whole reply's (so no part of a tag was given out as content)."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(REPLY)), 0 if seed == 0 else rng.randint(1, 12)))
    pieces = (
        list(REPLY) if seed == 0 else [REPLY[a:b] for a, b in zip([0, *cuts], [*cuts, len(REPLY)])]
    )
    stream, content, calls = ToolCallStream(), "", []
    for i, piece in enumerate(pieces):
        text, found = stream.feed(piece, final=i == len(pieces) - 1)
        content += text
        calls += found
    whole_content, whole_calls = parse_tool_calls(REPLY)
    assert content == whole_content and calls_of(calls) == calls_of(whole_calls)


class ScriptedEngine:
    """The client interface of `AsyncClient`: every request gets `reply`, in `pieces`."""

    def __init__(self, reply: str, pieces: int) -> None:
        self.reply, self.pieces = reply, pieces
        self.sampling: list[SamplingParams] = []

    async def generate(
        self,
        prompt: Prompt,
        sampling: SamplingParams,
        request_id: str | None = None,
        options: PromptOptions | None = None,
    ) -> AsyncIterator[RequestDelta]:
        self.sampling.append(sampling)
        size = -(-len(self.reply) // self.pieces)
        parts = [self.reply[i : i + size] for i in range(0, len(self.reply), size)]
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            yield RequestDelta(
                seq=0, text=part, token_ids=[7], text_offset=i * size, token_offset=i,
                prompt_token_ids=[1, 2] if i == 0 else None,
                finish_reason=FinishReason.STOP if last else None,
            )  # fmt: skip


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("tools"))


def app_client(model_path: Path, engine: ScriptedEngine, **server: object) -> openai.AsyncOpenAI:
    config = EngineConfig(model=str(model_path), server=ServerConfig(**server)).resolve()
    app = build_app(OpenAIServer(engine, config, load_tokenizer(str(model_path)), {}))  # type: ignore[arg-type]
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server/v1")
    return openai.AsyncOpenAI(base_url="http://server/v1", api_key="x", http_client=http)


TOOLS = [{"type": "function", "function": {"name": n}} for n in ("weather", "clock")]
ASK = [{"role": "user", "content": "weather?"}]


async def test_auto_tool_choice_through_the_chat_endpoint(model_path: Path) -> None:
    """With the flags: the calls (content before them), finish "tool_calls", whole and
    streamed alike, special tokens kept in the text for the parser; a reply with no call is
    content. Without them "auto" is a 400 naming the flags."""
    engine = ScriptedEngine(REPLY, pieces=9)
    api = app_client(model_path, engine, enable_auto_tool_choice=True, tool_call_parser="hermes")
    whole = await api.chat.completions.create(model=str(model_path), messages=ASK, tools=TOOLS)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look.\n"
    names = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert names == [
        ("weather", {"city": "Paris", "note": "très beau"}),
        ("clock", {"zone": "CET"}),
    ]
    assert engine.sampling[-1].skip_special_tokens is False
    stream = await api.chat.completions.create(
        model=str(model_path), messages=ASK, tools=TOOLS, tool_choice="auto", stream=True
    )
    chunks = [chunk async for chunk in stream]
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == "Let me look.\n"
    streamed = [(t.index, t.function.name, json.loads(t.function.arguments))
                for d in deltas for t in d.delta.tool_calls or []]  # fmt: skip
    assert streamed == [(i, *call) for i, call in enumerate(names)]
    assert deltas[-1].finish_reason == "tool_calls"
    plain = app_client(model_path, ScriptedEngine("No tools needed.", pieces=3),
                       enable_auto_tool_choice=True, tool_call_parser="hermes")  # fmt: skip
    reply = await plain.chat.completions.create(model=str(model_path), messages=ASK, tools=TOOLS)
    assert reply.choices[0].message.content == "No tools needed."
    assert reply.choices[0].finish_reason == "stop" and not reply.choices[0].message.tool_calls
    without = app_client(model_path, ScriptedEngine(REPLY, pieces=2))
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        await without.chat.completions.create(model=str(model_path), messages=ASK, tools=TOOLS)


def test_the_server_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="needs a tool_call_parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="not one of"):
        ServerConfig(enable_auto_tool_choice=True, tool_call_parser="llama3_json")
