"""vLLM's `openai` tool-call parser (GPT-OSS's harmony messages, `--enable-auto-tool-choice
--tool-call-parser openai`): each message to `functions.NAME` a call, the final channel and
preambles the content, no marker or header in either; whole or as the text streams in, in any
pieces; and through the chat endpoint (the app in-process, against an engine stand-in that
replies with a scripted harmony text in pieces), with and without `--reasoning-parser
openai_gptoss`."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from pagedserve.api.cli import build_parser, server_config
from pagedserve.api.tool_parsers import PARSERS, parse_tool_calls
from pagedserve.config import ServerConfig
from tests.test_tool_parsers import ScriptedEngine, app_client
from tests.tiny_models import save_tiny_model

PARSER = "openai"
THOUGHT = "Need the weather. Call the tool."
ANSWER = "It is sunny in Paris."
ANALYSIS = f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Let me look.<|end|>"
FINAL = f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
WEATHER_JSON = '{"city": "Paris", "note": "très beau"}'
WEATHER = ("get_weather", WEATHER_JSON)
CLOCK = ("clock", '{"zone": "CET"}')
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    f"<|message|>{WEATHER_JSON}<|call|>"
)
# the recipient before the channel, the content type after it
CLOCK_HEADER = "<|start|>assistant to=functions.clock<|channel|>commentary json<|message|>"
CLOCK_CALL = CLOCK_HEADER + CLOCK[1]

# a reply's text (special tokens kept) -> (content, [(function, arguments)])
REPLIES = {
    "one call": (ANALYSIS + CALL, (None, [WEATHER])),
    "two calls in a row": (f"{ANALYSIS}{CALL}{CLOCK_CALL}<|call|>", (None, [WEATHER, CLOCK])),
    "a preamble, then a call": (
        PREAMBLE.removeprefix("<|start|>assistant") + CALL,
        ("Let me look.", [WEATHER]),
    ),
    "a final answer and no call": (ANALYSIS + FINAL, (ANSWER, [])),
    "no <|constrain|>": (
        f"{ANALYSIS}<|start|>assistant<|channel|>commentary to=functions.get_weather"
        f"<|message|>{WEATHER_JSON}<|call|>",
        (None, [WEATHER]),
    ),
    "the recipient before the channel": (f"{ANALYSIS}{CLOCK_CALL}<|call|>", (None, [CLOCK])),
    "no <|call|> at the end": (ANALYSIS + CALL.removesuffix("<|call|>"), (None, [WEATHER])),
    "arguments re-written from JSON": (
        CLOCK_HEADER + '{\n  "zone":"CET"\n}<|call|>',
        (None, [CLOCK]),
    ),
    "arguments that are not JSON, kept": (
        "<|channel|>commentary to=functions.clock<|constrain|>text<|message|>zone CET<|call|>",
        (None, [("clock", "zone CET")]),
    ),
    "a call cut by max_tokens": (ANALYSIS + CALL[:-20], (None, [])),
    "a built-in tool's call": (
        '<|channel|>analysis to=browser.search<|message|>{"query": "Paris"}<|call|>',
        (None, []),
    ),
    "a call, then the final answer": (f"{ANALYSIS}{CALL}{FINAL}", (ANSWER, [WEATHER])),
}


def found(reply: tuple[str | None, list[dict]]) -> tuple[str | None, list[tuple[str, str]]]:
    """A parse's content and (function, arguments) of its calls, checking their shape."""
    content, calls = reply
    assert [call["index"] for call in calls] == list(range(len(calls)))
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    assert len({call["id"] for call in calls}) == len(calls)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("name", REPLIES)
def test_whole_replies(name: str) -> None:
    reply, expected = REPLIES[name]
    assert found(parse_tool_calls(reply, PARSER)) == expected


def streamed(pieces: list[str]) -> tuple[str | None, list[dict]]:
    """The content and the calls a stream gives out for the pieces, joined."""
    stream, content, calls = PARSERS[PARSER](), "", []
    for i, piece in enumerate(pieces):
        more_content, more_calls = stream.feed(piece, final=i == len(pieces) - 1)
        content, calls = content + more_content, calls + more_calls
    return content or None, calls


@pytest.mark.parametrize("name", REPLIES)
def test_streamed_pieces_give_what_the_whole_reply_gives(name: str) -> None:
    """Every split of the reply in two, and the reply one character at a time: no part of a
    marker or header is given out, and nothing is lost."""
    reply, expected = REPLIES[name]
    for cut in range(1, len(reply)):
        assert found(streamed([reply[:cut], reply[cut:]])) == expected, cut
    assert found(streamed(list(reply))) == expected


def test_a_call_goes_out_when_its_message_ends() -> None:
    """Content leaves as it comes; each call once its <|call|> (or the next message) comes,
    before the reply ends."""
    stream = PARSERS[PARSER]()
    assert stream.feed(ANALYSIS + PREAMBLE[:-7], final=False) == ("Let me look.", [])
    assert stream.feed(PREAMBLE[-7:] + CALL[:-4], final=False) == ("", [])
    content, calls = stream.feed(CALL[-4:] + CLOCK_CALL, final=False)
    assert content == "" and found(("", calls))[1] == [WEATHER]
    content, calls = stream.feed("", final=True)
    assert content == "" and [call["index"] for call in calls] == [1]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("harmony_tools"))


ASK = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "clock")]
# an analysis, a preamble, two calls: the last without its <|call|> (the end token)
REPLY = f"{ANALYSIS}{PREAMBLE}{CALL}{CLOCK_CALL}"


@pytest.mark.parametrize("reasoning_parser", [None, "openai_gptoss"])
async def test_tool_calls_through_the_chat_endpoint(
    model_path: Path, reasoning_parser: str | None
) -> None:
    """The calls with their names and JSON arguments, the preamble as content, finish
    "tool_calls", whole and streamed alike; the analysis is reasoning_content with the
    reasoning parser, and nowhere without it; special tokens kept in the text."""
    engine = ScriptedEngine(REPLY, pieces=11)
    api = app_client(model_path, engine, enable_auto_tool_choice=True, tool_call_parser=PARSER,
                     reasoning_parser=reasoning_parser)  # fmt: skip
    reasoning = THOUGHT if reasoning_parser else None
    whole = await api.chat.completions.create(model=str(model_path), messages=ASK, tools=TOOLS)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    assert (choice.message.model_extra or {}).get("reasoning_content") == reasoning
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert calls == [WEATHER, CLOCK]
    assert json.loads(calls[0][1]) == {"city": "Paris", "note": "très beau"}
    assert engine.sampling[-1].skip_special_tokens is False
    stream = await api.chat.completions.create(
        model=str(model_path), messages=ASK, tools=TOOLS, stream=True
    )
    deltas = [chunk.choices[0] async for chunk in stream if chunk.choices]
    extra = "".join((d.delta.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert (extra or None) == reasoning
    assert "".join(d.delta.content or "" for d in deltas) == "Let me look."
    streamed_calls = [(t.index, t.id, t.function.name, t.function.arguments)
                      for d in deltas for t in d.delta.tool_calls or []]  # fmt: skip
    assert [(index, name, arguments) for index, _, name, arguments in streamed_calls] == [
        (0, *WEATHER),
        (1, *CLOCK),
    ]
    assert all(call_id.startswith("chatcmpl-tool-") for _, call_id, _, _ in streamed_calls)
    assert deltas[-1].finish_reason == "tool_calls"


@pytest.mark.parametrize("reasoning_parser", [None, "openai_gptoss"])
async def test_a_final_answer_through_the_chat_endpoint(
    model_path: Path, reasoning_parser: str | None
) -> None:
    """No call: the final channel's text is the content (never the analysis or a marker),
    finish "stop", whole and streamed."""
    engine = ScriptedEngine(ANALYSIS + FINAL, pieces=7)
    api = app_client(model_path, engine, enable_auto_tool_choice=True, tool_call_parser=PARSER,
                     reasoning_parser=reasoning_parser)  # fmt: skip
    whole = await api.chat.completions.create(model=str(model_path), messages=ASK, tools=TOOLS)
    choice = whole.choices[0]
    assert choice.message.content == ANSWER and choice.finish_reason == "stop"
    assert not choice.message.tool_calls
    stream = await api.chat.completions.create(
        model=str(model_path), messages=ASK, tools=TOOLS, stream=True
    )
    deltas = [chunk.choices[0] async for chunk in stream if chunk.choices]
    assert "".join(d.delta.content or "" for d in deltas) == ANSWER
    assert not any(d.delta.tool_calls for d in deltas) and deltas[-1].finish_reason == "stop"


def test_the_parser_is_a_serve_flag_and_takes_only_harmony_reasoning() -> None:
    args = build_parser().parse_args(
        ["serve", "--enable-auto-tool-choice", "--tool-call-parser", PARSER]
    )
    assert server_config(args).tool_call_parser == PARSER
    with pytest.raises(ValueError, match="openai_gptoss or none"):
        ServerConfig(enable_auto_tool_choice=True, tool_call_parser=PARSER,
                     reasoning_parser="deepseek_r1")  # fmt: skip


async def test_without_the_flags_auto_is_a_400(model_path: Path) -> None:
    api = app_client(model_path, ScriptedEngine(REPLY, pieces=2), reasoning_parser="openai_gptoss")
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        await api.chat.completions.create(model=str(model_path), messages=ASK, tools=TOOLS)
