"""vLLM's `deepseek_r1` and `qwen3` reasoning parsers: a reply's <think>...</think> as the
message's reasoning_content, whole or as the text streams in; and through the chat endpoint
(the app in-process, against an engine stand-in that replies with a scripted text in pieces)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pagedserve.api.reasoning_parsers import split_reasoning, stream_for
from pagedserve.config import ServerConfig
from tests.test_tool_parsers import ScriptedEngine, app_client
from tests.tiny_models import save_tiny_model

THOUGHT = "The user asks 2 + 2. That is 4 </thin not yet."
REPLY = f"<think>{THOUGHT}</think>It is 4."
ASK = [{"role": "user", "content": "2 + 2?"}]


def test_whole_replies() -> None:
    """deepseek_r1: thinking up to </think> (an opening tag dropped), all of an unclosed reply;
    qwen3: reasoning only between both tags, else all content."""
    assert split_reasoning(REPLY, "deepseek_r1") == (THOUGHT, "It is 4.")
    assert split_reasoning(f"{THOUGHT}</think>It is 4.", "deepseek_r1") == (THOUGHT, "It is 4.")
    assert split_reasoning(f"<think>{THOUGHT}", "deepseek_r1") == (THOUGHT, None)
    assert split_reasoning(f"{THOUGHT}</think>", "deepseek_r1") == (THOUGHT, None)
    assert split_reasoning(REPLY, "qwen3") == (THOUGHT, "It is 4.")
    assert split_reasoning(f"<think>{THOUGHT}", "qwen3") == (None, f"<think>{THOUGHT}")
    assert split_reasoning("It is 4.", "qwen3") == (None, "It is 4.")


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("seed", range(6))
def test_streamed_pieces_give_what_the_whole_reply_gives(parser: str, seed: int) -> None:
    """The reply fed in random pieces (one character each for seed 0): reasoning and content
    joined are the whole reply's, so no part of a tag was given out as text."""
    replies = [REPLY, "It is 4."] + (
        [f"{THOUGHT}</think>It is 4."] if parser == "deepseek_r1" else []
    )
    for reply in replies:
        rng = random.Random(seed)
        cuts = sorted(
            rng.sample(
                range(1, len(reply)), 0 if seed == 0 else rng.randint(1, min(12, len(reply) - 1))
            )
        )
        bounds = zip([0, *cuts], [*cuts, len(reply)])
        pieces = list(reply) if seed == 0 else [reply[a:b] for a, b in bounds]
        stream, reasoning, content = stream_for(parser), "", ""
        for i, piece in enumerate(pieces):
            more_reasoning, more_content = stream.feed(piece, final=i == len(pieces) - 1)
            reasoning, content = reasoning + more_reasoning, content + more_content
        assert (reasoning or None, content or None) == split_reasoning(reply, parser)


def test_streamed_reasoning_goes_out_before_the_reply_ends() -> None:
    stream = stream_for("deepseek_r1")
    assert stream.feed("<think>Two plus", final=False) == ("Two plus", "")
    assert stream.feed(" two</th", final=False) == (" two", "")  # "</th" may be the tag
    assert stream.feed("ink>Four", final=False) == ("", "Four")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("reasoning"))


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
async def test_reasoning_content_through_the_chat_endpoint(model_path: Path, parser: str) -> None:
    """With --reasoning-parser: reasoning_content and content, whole and streamed alike;
    without it the reply is all content."""
    api = app_client(model_path, ScriptedEngine(REPLY, pieces=11), reasoning_parser=parser)
    whole = await api.chat.completions.create(model=str(model_path), messages=ASK)
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] == THOUGHT and message.content == "It is 4."
    stream = await api.chat.completions.create(model=str(model_path), messages=ASK, stream=True)
    deltas = [chunk.choices[0].delta async for chunk in stream if chunk.choices]
    streamed = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert streamed == THOUGHT
    assert "".join(d.content or "" for d in deltas) == "It is 4."
    plain = app_client(model_path, ScriptedEngine(REPLY, pieces=3))
    reply = await plain.chat.completions.create(model=str(model_path), messages=ASK)
    assert reply.choices[0].message.content == REPLY
    assert "reasoning_content" not in (reply.choices[0].message.model_extra or {})


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
async def test_reasoning_output_item_through_the_responses_endpoint(
    model_path: Path, parser: str
) -> None:
    """/v1/responses with --reasoning-parser: a reasoning item (its reasoning_text) before the
    message, whole and streamed (reasoning_text deltas at output index 0, the message's text
    at 1); reasoning_tokens counts the pieces that carried the thinking or its tags (one token
    each here). Without the parser: one message of the whole reply, no reasoning tokens."""
    pieces = 11
    api = app_client(model_path, ScriptedEngine(REPLY, pieces), reasoning_parser=parser)
    whole = await api.responses.create(model=str(model_path), input="2 + 2?")
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == THOUGHT and whole.output_text == "It is 4."
    size = -(-len(REPLY) // pieces)
    thinking_ends = len(f"<think>{THOUGHT}</think>")
    assert whole.usage.output_tokens_details.reasoning_tokens == -(-thinking_ends // size)
    stream = await api.responses.create(model=str(model_path), input="2 + 2?", stream=True)
    events = [event async for event in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning = [e for e in events if e.type == "response.reasoning_text.delta"]
    text = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in reasoning) == THOUGHT and {
        e.output_index for e in reasoning
    } == {0}
    assert "".join(e.delta for e in text) == "It is 4." and {e.output_index for e in text} == {1}
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.type for item in done] == ["reasoning", "message"]
    assert done[0].content[0].text == THOUGHT
    final = events[-1]
    assert final.type == "response.completed" and final.response.output_text == "It is 4."
    assert final.response.usage.output_tokens_details.reasoning_tokens == -(-thinking_ends // size)
    async with api.responses.stream(model=str(model_path), input="2 + 2?") as helper:
        assert (await helper.get_final_response()).output_text == "It is 4."  # the SDK's helper
    plain = app_client(model_path, ScriptedEngine(REPLY, pieces=3))
    reply = await plain.responses.create(model=str(model_path), input="2 + 2?")
    assert [item.type for item in reply.output] == ["message"] and reply.output_text == REPLY
    assert reply.usage.output_tokens_details.reasoning_tokens == 0


def test_the_parser_name_is_checked() -> None:
    with pytest.raises(ValueError, match="not one of"):
        ServerConfig(reasoning_parser="granite")
