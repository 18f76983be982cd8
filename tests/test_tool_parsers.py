"""vLLM's `hermes` and `llama3_json` tool-call parsers for "auto" tool choice: calls in the
reply's text, whole or as the text streams in; and through the chat endpoint (the app
in-process, against an engine stand-in that replies with a scripted text in pieces), with and
without --enable-auto-tool-choice."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from pagedserve.actors.chat import load_tokenizer
from pagedserve.actors.messages import (
    FinishReason,
    LoRARequest,
    PoolingParams,
    PromptOptions,
    RequestDelta,
    SamplingParams,
)
from pagedserve.api.client_core import Prompt
from pagedserve.api.openai_server import OpenAIServer, build_app
from pagedserve.api.tool_parsers import PARSERS, parse_tool_calls
from pagedserve.config import EngineConfig, ServerConfig
from tests.tiny_models import save_tiny_model

WEATHER = '{"name": "weather", "arguments": {"city": "Paris", "note": "très beau"}}'
CLOCK = '{"name": "clock", "arguments": {"zone": "CET"}}'
REPLY = f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{CLOCK}</tool_call>"
LLAMA_WEATHER = WEATHER.replace("arguments", "parameters")
LLAMA_REPLY = f"<|python_tag|>{LLAMA_WEATHER}; {CLOCK}"  # "arguments" read as well
REPLIES = {"hermes": (REPLY, "Let me look.\n"), "llama3_json": (LLAMA_REPLY, None)}
WEATHER_CALL = ("weather", {"city": "Paris", "note": "très beau"})


def calls_of(calls: list[dict]) -> list[tuple[int, str, dict]]:
    return [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls]  # fmt: skip


def test_whole_hermes_replies() -> None:
    """Content before the first block; each block a call (arguments as JSON text); a block
    the reply leaves open is read if it is JSON, else it stays content; no tag: content."""
    content, calls = parse_tool_calls(REPLY, "hermes")
    assert content == "Let me look.\n"
    assert calls_of(calls) == [(0, *WEATHER_CALL), (1, "clock", {"zone": "CET"})]
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    assert calls_of(parse_tool_calls(f"<tool_call>{CLOCK}", "hermes")[1]) == [
        (0, "clock", {"zone": "CET"})
    ]
    cut = '<tool_call>{"name": "clock", "argu'
    assert parse_tool_calls(cut, "hermes") == (cut, [])
    assert parse_tool_calls("a < b, <tool_ <tool", "hermes") == ("a < b, <tool_ <tool", [])
    assert parse_tool_calls("", "hermes") == (None, [])


def test_whole_llama3_json_replies() -> None:
    """JSON calls separated by ";" (after <|python_tag|> or not), "parameters" or
    "arguments"; a reply that is not all calls is content, whatever it starts with."""
    expected = [(0, *WEATHER_CALL), (1, "clock", {"zone": "CET"})]
    assert calls_of(parse_tool_calls(LLAMA_REPLY, "llama3_json")[1]) == expected
    content, calls = parse_tool_calls(f"  {LLAMA_WEATHER}\n", "llama3_json")
    assert content is None and calls_of(calls) == expected[:1]
    for text in ("Paris is sunny.", '{"name": "clock", "parame', "{not json}; x", "<|pyth"):
        assert parse_tool_calls(text, "llama3_json") == (text, [])


@pytest.mark.parametrize("parser", list(REPLIES))
@pytest.mark.parametrize("seed", range(6))
def test_streamed_pieces_give_what_the_whole_reply_gives(parser: str, seed: int) -> None:
    """The reply fed in random pieces (one character each for seed 0): the content joined and
    the calls are the whole reply's (so no part of a tag was given out as content)."""
    reply = REPLIES[parser][0]
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(reply)), 0 if seed == 0 else rng.randint(1, 12)))
    bounds = zip([0, *cuts], [*cuts, len(reply)])
    pieces = list(reply) if seed == 0 else [reply[a:b] for a, b in bounds]
    stream, content, calls = PARSERS[parser](), "", []
    for i, piece in enumerate(pieces):
        text, found = stream.feed(piece, final=i == len(pieces) - 1)
        content += text
        calls += found
    whole_content, whole_calls = parse_tool_calls(reply, parser)
    assert (content or None) == whole_content and calls_of(calls) == calls_of(whole_calls)
    for text in ("Plain words, then more.", "  spaced out"):  # content streams as it comes
        stream = PARSERS[parser]()
        given = [stream.feed(piece, final=False)[0] for piece in (text[:9], text[9:])]
        assert "".join(given) == text and given[0]


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
        priority: int = 0,
        lora: LoRARequest | None = None,
        pooling: PoolingParams | None = None,
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


@pytest.mark.parametrize("parser", list(REPLIES))
async def test_auto_tool_choice_through_the_chat_endpoint(model_path: Path, parser: str) -> None:
    """With the flags: the calls (and any content before them), finish "tool_calls", whole
    and streamed alike, special tokens kept in the text for the parser; a reply with no call
    is content. Without them "auto" is a 400 naming the flags."""
    reply, content = REPLIES[parser]
    engine = ScriptedEngine(reply, pieces=9)
    api = app_client(model_path, engine, enable_auto_tool_choice=True, tool_call_parser=parser)
    whole = await api.chat.completions.create(model=str(model_path), messages=ASK, tools=TOOLS)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [WEATHER_CALL, ("clock", {"zone": "CET"})]
    assert engine.sampling[-1].skip_special_tokens is False
    stream = await api.chat.completions.create(
        model=str(model_path), messages=ASK, tools=TOOLS, tool_choice="auto", stream=True
    )
    deltas = [chunk.choices[0] async for chunk in stream if chunk.choices]
    assert "".join(d.delta.content or "" for d in deltas) == (content or "")
    streamed = [(t.index, t.function.name, json.loads(t.function.arguments))
                for d in deltas for t in d.delta.tool_calls or []]  # fmt: skip
    assert streamed == [(i, *call) for i, call in enumerate(calls)]
    assert deltas[-1].finish_reason == "tool_calls"
    plain = app_client(model_path, ScriptedEngine("No tools needed.", pieces=3),
                       enable_auto_tool_choice=True, tool_call_parser=parser)  # fmt: skip
    reply_text = await plain.chat.completions.create(
        model=str(model_path), messages=ASK, tools=TOOLS
    )
    assert reply_text.choices[0].message.content == "No tools needed."
    assert reply_text.choices[0].finish_reason == "stop"
    assert not reply_text.choices[0].message.tool_calls
    without = app_client(model_path, ScriptedEngine(reply, pieces=2))
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        await without.chat.completions.create(model=str(model_path), messages=ASK, tools=TOOLS)


def test_the_server_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="needs a tool_call_parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="not one of"):
        ServerConfig(enable_auto_tool_choice=True, tool_call_parser="mistral")
