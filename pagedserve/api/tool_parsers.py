"""Tool calls in a model's free text, for "auto" tool choice (`--enable-auto-tool-choice
--tool-call-parser NAME`, vLLM's flags and parser names). Each parser reads a choice's text as
it grows (`feed`: the content and the calls to give the client next).

hermes (NousResearch's Hermes models, Qwen2.5, Qwen3): one call a block

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

with the text before the first block as the reply's content (text between and after blocks is
dropped, as vLLM's parser does). Content is given out as soon as it cannot be the start of a
tag, each call whole once its block closes (a block the reply leaves open is read at its end
if it is JSON, else it is given as content).

llama3_json (Llama 3.1-3.3): a reply that starts (after white space) with `<|python_tag|>` or
`{` is calls, JSON objects {"name": ..., "parameters": {...}} separated by ";", given when the
reply ends (all of it as content if it is not calls after all); any other reply is content,
streamed as it comes.

openai (GPT-OSS): the reply's harmony messages (reasoning_parsers.HarmonyStream reads them),
each message to `functions.NAME` a call of NAME, its text the arguments (JSON re-written by
json.dumps, as vLLM's parser does)

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":
    "Paris"}<|call|>

(or `<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>...`),
given once its message ends; a call the reply leaves open (the `<|call|>` that stopped it not in
the text) counts if its text is whole JSON. The content is the final channel's text and the
commentary preambles' (no recipient), streamed as it comes; the analysis channel is never
content (the chat's reasoning_content with `--reasoning-parser openai_gptoss`, else dropped),
and no marker or header is in either. This parser reads the reply as the model wrote it, not
the reasoning parser's content (`reads_harmony`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pagedserve.api.reasoning_parsers import HarmonyStream
from pagedserve.api.tools import tool_call
from pagedserve.config import TOOL_CALL_PARSERS as TOOL_CALL_PARSERS

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
HARMONY_TOOLS = "openai"


@dataclass
class HermesStream:
    """One choice's text in the hermes format, fed as it comes."""

    text: str = ""
    done: int = 0  # characters of text already given out (as content or in calls) or dropped
    in_block: bool = False
    started: bool = False  # a block has begun: text between blocks is dropped (vLLM's rule)
    calls: list[dict] = field(default_factory=list)  # every call so far (OpenAI's shape)

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict]]:
        """The content and the calls (with their `index`) that `delta` completes; `final`: the
        reply has ended, so nothing is held back."""
        self.text += delta
        content, calls = "", []
        while True:
            if self.in_block:
                end = self.text.find(CLOSE_TAG, self.done)
                if end < 0:
                    if final:
                        content += self._close_open_block(calls)
                    break
                calls += self._block(self.text[self.done + len(OPEN_TAG) : end])
                self.done, self.in_block = end + len(CLOSE_TAG), False
                continue
            start = self.text.find(OPEN_TAG, self.done)
            if start < 0:
                keep = 0 if final else _partial_tag(self.text, self.done)
                if not self.started:
                    content += self.text[self.done : len(self.text) - keep]
                self.done = len(self.text) - keep
                break
            if not self.started:
                content += self.text[self.done : start]
            self.done, self.in_block, self.started = start, True, True
        return content, calls

    def _block(self, body: str) -> list[dict]:
        """The call of one block's JSON (none when it is not a call: its text is lost, as in
        vLLM's parser)."""
        try:
            value = json.loads(body)
        except ValueError:
            return []
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return []
        arguments = value.get("arguments", {})
        call = tool_call(value["name"], json.dumps(arguments, ensure_ascii=False))
        call = {"index": len(self.calls), **call}
        self.calls.append(call)
        return [call]

    def _close_open_block(self, calls: list[dict]) -> str:
        """The reply ended inside a block: its call if the rest is one, else the rest as text."""
        rest = self.text[self.done :]
        found = self._block(rest[len(OPEN_TAG) :])
        self.done, self.in_block = len(self.text), False
        calls += found
        return "" if found else rest


@dataclass
class Llama3JsonStream:
    """One choice's text in the llama3_json format, fed as it comes."""

    text: str = ""
    mode: str | None = None  # "calls" or "content"; None: white space or a tag's start so far
    calls: list[dict] = field(default_factory=list)

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict]]:
        self.text += delta
        if self.mode is None:
            head = self.text.lstrip()
            if head.startswith((PYTHON_TAG, "{")):
                self.mode = "calls"
            elif final or (head and not PYTHON_TAG.startswith(head)):
                self.mode = "content"
                return self.text, []
            else:
                return "", []
        if self.mode == "content":
            return delta, []
        if not final:
            return "", []
        self.calls = _json_calls(self.text.lstrip().removeprefix(PYTHON_TAG))
        return ("" if self.calls else self.text), self.calls


def _json_calls(text: str) -> list[dict]:
    """The calls of `{...}; {...}`; none unless every part is one."""
    decoder, calls, position = json.JSONDecoder(), [], 0
    while position < len(text):
        try:
            value, position = decoder.raw_decode(text, position)
        except ValueError:
            return []
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return []
        arguments = value.get("parameters", value.get("arguments", {}))
        call = tool_call(value["name"], json.dumps(arguments, ensure_ascii=False))
        calls.append({"index": len(calls), **call})
        while position < len(text) and text[position] in " \t\r\n;":
            position += 1
    return calls


@dataclass
class HarmonyToolStream:
    """One choice's text in GPT-OSS's harmony format (openai), fed as it comes."""

    harmony: HarmonyStream = field(default_factory=HarmonyStream)
    calls: list[dict] = field(default_factory=list)

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict]]:
        _, content = self.harmony.feed(delta, final)
        ended = self.harmony.calls[len(self.calls) :]
        calls = [{"index": len(self.calls) + i, **tool_call(name, _arguments(text))}
                 for i, (name, text) in enumerate(ended)]  # fmt: skip
        self.calls += calls
        return content, calls


def _arguments(arguments: str) -> str:
    """A harmony call's arguments: its JSON re-written, or (not JSON) its text as is."""
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:
        return arguments


ToolCallStream = HermesStream | Llama3JsonStream | HarmonyToolStream
PARSERS: dict[str, type[ToolCallStream]] = {
    "hermes": HermesStream,
    "llama3_json": Llama3JsonStream,
    HARMONY_TOOLS: HarmonyToolStream,
}


def reads_harmony(parser: str | None) -> bool:
    """Whether the tool-call parser reads GPT-OSS's harmony reply as written (markers and
    analysis included): the chat's content is then the harmony messages' content, whatever
    the reasoning parser."""
    return parser == HARMONY_TOOLS


def _partial_tag(text: str, start: int) -> int:
    """How many of text's last characters (after `start`) could begin OPEN_TAG."""
    for size in range(min(len(OPEN_TAG) - 1, len(text) - start), 0, -1):
        if OPEN_TAG.startswith(text[-size:]):
            return size
    return 0


def parse_tool_calls(text: str, parser: str) -> tuple[str | None, list[dict]]:
    """A whole reply's content (None if empty) and calls."""
    content, calls = PARSERS[parser]().feed(text, final=True)
    return content or None, calls
