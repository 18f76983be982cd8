"""vLLM's `openai_gptoss` reasoning parser (GPT-OSS's harmony messages): the analysis channel as
reasoning_content, the final channel and a commentary preamble as content, no marker, header or
end token in either; whole or as the text streams in, in any pieces; and through the chat and
Responses endpoints (the app in-process, against an engine stand-in that replies with a scripted
harmony text in pieces), whose requests then keep special tokens in the text."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.api.cli import build_parser, server_config
from pagedserve.api.reasoning_parsers import split_reasoning, stream_for
from tests.test_tool_parsers import ScriptedEngine, app_client
from tests.tiny_models import save_tiny_model

PARSER = "openai_gptoss"
THOUGHT = "The user greets me. I should answer."
ANSWER = "Hello! How can I help?"
ANALYSIS = f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
FINAL = f"<|start|>assistant<|channel|>final<|message|>{ANSWER}"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
REPLY = f"{ANALYSIS}{FINAL}<|return|>"

# a reply's text (special tokens kept) -> (reasoning, content)
REPLIES = {
    "analysis then final": (ANALYSIS + FINAL, (THOUGHT, ANSWER)),
    "an end token at the end": (REPLY, (THOUGHT, ANSWER)),
    "<|endoftext|> at the end": (f"{ANALYSIS}{FINAL}<|endoftext|>", (THOUGHT, ANSWER)),
    "final only": (f"<|channel|>final<|message|>{ANSWER}<|return|>", (None, ANSWER)),
    "cut by max_tokens in the analysis": (
        "<|channel|>analysis<|message|>The user",
        ("The user", None),
    ),
    "cut inside a header's marker": (f"{ANALYSIS}<|start|>assistant<|chan", (THOUGHT, None)),
    "cut inside a message's end marker": (ANALYSIS[:-3], (THOUGHT, None)),
    "cut inside the final's header": (
        f"{ANALYSIS}<|start|>assistant<|channel|>fin",
        (THOUGHT, None),
    ),
    "a commentary preamble, then a tool call": (
        f"<|channel|>commentary<|message|>Let me look.<|end|>{CALL}",
        (None, "Let me look."),
    ),
    "analysis, then a tool call": (ANALYSIS + CALL, (THOUGHT, None)),
    "a recipient in the role": (
        f"{ANALYSIS}<|start|>assistant to=functions.x<|channel|>commentary json<|message|>{{}}",
        (THOUGHT, None),
    ),
    "messages of a field, joined by newlines": (
        f"{ANALYSIS}<|start|>assistant<|channel|>analysis<|message|>More.<|end|>"
        f"<|start|>assistant<|channel|>commentary<|message|>Let me see.<|end|>{FINAL}<|return|>",
        (f"{THOUGHT}\nMore.", f"Let me see.\n{ANSWER}"),
    ),
    "text like a marker's start": (
        "<|channel|>final<|message|>1 < 2, and <| is no marker: 3 <",
        (None, "1 < 2, and <| is no marker: 3 <"),
    ),
}


@pytest.mark.parametrize("name", REPLIES)
def test_whole_replies(name: str) -> None:
    reply, expected = REPLIES[name]
    assert split_reasoning(reply, PARSER) == expected


def streamed(pieces: list[str]) -> tuple[str | None, str | None]:
    """The reasoning and content a stream gives out for the pieces, joined."""
    stream, reasoning, content = stream_for(PARSER), "", ""
    for i, piece in enumerate(pieces):
        more_reasoning, more_content = stream.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + more_reasoning, content + more_content
    return reasoning or None, content or None


@pytest.mark.parametrize("name", REPLIES)
def test_streamed_pieces_give_what_the_whole_reply_gives(name: str) -> None:
    """Every split of the reply in two, and the reply one character at a time: no part of a
    marker or header is given out as text, and nothing is lost."""
    reply, expected = REPLIES[name]
    for cut in range(1, len(reply)):
        assert streamed([reply[:cut], reply[cut:]]) == expected, cut
    assert streamed(list(reply)) == expected


def test_streamed_text_goes_out_before_the_reply_ends() -> None:
    """Text leaves as soon as it cannot be a marker's start; a header gives out nothing."""
    stream = stream_for(PARSER)
    assert stream.feed("<|channel|>analysis<|mess", final=False) == ("", "")
    assert stream.feed("age|>Two plus", final=False) == ("Two plus", "")
    assert stream.feed(" two<|en", final=False) == (" two", "")  # "<|en" may be <|end|>
    assert stream.feed("d|><|start|>assistant<|channel|>final<|message|>", final=False) == ("", "")
    assert stream.feed("Four<", final=False) == ("", "Four")
    assert stream.feed("|return|>", final=True) == ("", "")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("harmony"))


ASK = [{"role": "user", "content": "Hi"}]


async def test_reasoning_content_through_the_chat_endpoint(model_path: Path) -> None:
    """reasoning_content and content, whole and streamed alike; the engine is asked to keep
    special tokens in the text (the markers the parser reads)."""
    engine = ScriptedEngine(REPLY, pieces=13)
    api = app_client(model_path, engine, reasoning_parser=PARSER)
    whole = await api.chat.completions.create(model=str(model_path), messages=ASK)
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] == THOUGHT and message.content == ANSWER
    assert engine.sampling[-1].skip_special_tokens is False
    stream = await api.chat.completions.create(model=str(model_path), messages=ASK, stream=True)
    deltas = [chunk.choices[0].delta async for chunk in stream if chunk.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == THOUGHT
    assert "".join(d.content or "" for d in deltas) == ANSWER
    assert engine.sampling[-1].skip_special_tokens is False


async def test_reasoning_output_item_through_the_responses_endpoint(model_path: Path) -> None:
    """/v1/responses: a reasoning item of the analysis, then the message of the final text,
    whole and streamed; reasoning_tokens counts the pieces from the one that completes the
    analysis's <|message|> to the one that completes its <|end|> (one token each here)."""
    pieces = 13
    engine = ScriptedEngine(REPLY, pieces)
    api = app_client(model_path, engine, reasoning_parser=PARSER)
    size = -(-len(REPLY) // pieces)
    opened = REPLY.index(THOUGHT) - 1  # the last character of its <|message|>
    closed = len(ANALYSIS) - 1  # of its <|end|>
    reasoning_tokens = closed // size - opened // size + 1
    whole = await api.responses.create(model=str(model_path), input="Hi")
    assert engine.sampling[-1].skip_special_tokens is False
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == THOUGHT and whole.output_text == ANSWER
    assert whole.usage.output_tokens_details.reasoning_tokens == reasoning_tokens
    stream = await api.responses.create(model=str(model_path), input="Hi", stream=True)
    events = [event async for event in stream]
    assert engine.sampling[-1].skip_special_tokens is False
    reasoning = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    text = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(reasoning) == THOUGHT and "".join(text) == ANSWER
    final = events[-1]
    assert final.type == "response.completed" and final.response.output_text == ANSWER
    assert final.response.usage.output_tokens_details.reasoning_tokens == reasoning_tokens


@pytest.mark.parametrize("parser", [None, "deepseek_r1", "qwen3"])
async def test_other_parsers_still_skip_special_tokens(model_path: Path, parser: str) -> None:
    """Without openai_gptoss the requests' text is detokenized as before: special tokens
    skipped (the request's default), on the chat and Responses endpoints."""
    engine = ScriptedEngine("It is 4.", pieces=2)
    api = app_client(model_path, engine, reasoning_parser=parser)
    await api.chat.completions.create(model=str(model_path), messages=ASK)
    await api.responses.create(model=str(model_path), input="Hi")
    assert [sampling.skip_special_tokens for sampling in engine.sampling] == [True, True]


def test_the_serve_flag_takes_the_parser() -> None:
    args = build_parser().parse_args(["serve", "--reasoning-parser", PARSER])
    assert server_config(args).reasoning_parser == PARSER
