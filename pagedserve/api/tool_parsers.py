"""Tool calls in a model's free text, for "auto" tool choice (`--enable-auto-tool-choice
--tool-call-parser NAME`, vLLM's flags). The one parser here is vLLM's `hermes`: the format of
NousResearch's Hermes models and of Qwen2.5 / Qwen3, one call a block

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

with the text before the first block as the reply's content (text between and after blocks is
dropped, as vLLM's parser does). `ToolCallStream` reads a choice's text as it grows: content is
given out as soon as it cannot be the start of a tag, each call whole once its block closes (a
block the reply leaves open is read at its end if it is JSON, else it is given as content)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pagedserve.api.tools import tool_call
from pagedserve.config import TOOL_CALL_PARSERS as TOOL_CALL_PARSERS

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


@dataclass
class ToolCallStream:
    """One choice's text, fed as it comes; what `feed` returns is what the client gets next."""

    text: str = ""
    done: int = 0  # characters of text already given out (as content or in calls) or dropped
    in_block: bool = False
    started: bool = False  # a block has begun: text between blocks is dropped (vLLM's rule)
    num_calls: int = 0
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
        call = {"index": self.num_calls, **call}
        self.num_calls += 1
        self.calls.append(call)
        return [call]

    def _close_open_block(self, calls: list[dict]) -> str:
        """The reply ended inside a block: its call if the rest is one, else the rest as text."""
        rest = self.text[self.done :]
        found = self._block(rest[len(OPEN_TAG) :])
        self.done, self.in_block = len(self.text), False
        calls += found
        return "" if found else rest


def _partial_tag(text: str, start: int) -> int:
    """How many of text's last characters (after `start`) could begin OPEN_TAG."""
    for size in range(min(len(OPEN_TAG) - 1, len(text) - start), 0, -1):
        if OPEN_TAG.startswith(text[-size:]):
            return size
    return 0


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """A whole reply's content (None if empty) and calls."""
    stream = ToolCallStream()
    content, calls = stream.feed(text, final=True)
    return content or None, calls
