"""vLLM's reasoning parsers (`serve --reasoning-parser`): a reply's thinking goes to the
message's `reasoning_content`, the rest to `content`.

  deepseek_r1    the thinking is written between `<think>` and `</think>`, and the reply starts
                 in it (the chat template opened it): everything up to `</think>` is reasoning
                 (a `<think>` the model writes itself is dropped); a reply that never closes it
                 is all reasoning.
  qwen3          the same tags; only a reply holding both has reasoning: what lies between
                 them; any other reply is content.
  openai_gptoss  GPT-OSS's harmony messages (the prompt ends in `<|start|>assistant`), e.g.
                 `<|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final
                 <|message|>…<|return|>`: the analysis channel's text is reasoning, the final
                 channel's and a commentary preamble's (no recipient) content. A message with a
                 recipient (`to=functions.NAME`: a tool call) is neither: the `openai` tool-call
                 parser (tool_parsers.py) reads the calls. Headers and markers (special
                 tokens, which the server keeps in this parser's text: `keeps_special_tokens`)
                 go to neither field, nor does the reply's end token; a marker cut short at
                 the end of the reply is dropped. Messages of the same field are joined by a
                 newline. A reply cut inside a message keeps what it wrote of it (all
                 reasoning, if cut in the analysis).

Streamed, text goes out as soon as no tag or marker can be forming in it: a possible start of
one is held back until the next piece tells (or the reply ends). A streamed qwen3 reply that
opens `<think>` is reasoning until `</think>` comes, as in vLLM (it cannot wait to see the
close).
"""

from __future__ import annotations

import json
import re
from typing import Protocol

START, END = "<think>", "</think>"
HARMONY = "openai_gptoss"
# harmony's markers: the special tokens the model writes around and between its messages
MESSAGE_START, MESSAGE = "<|start|>", "<|message|>"  # a header's start; its end
MESSAGE_ENDS = ("<|end|>", "<|return|>", "<|call|>", "<|endoftext|>")
MARKERS = (MESSAGE_START, "<|channel|>", "<|constrain|>", MESSAGE, *MESSAGE_ENDS)
MARKER = re.compile("|".join(re.escape(marker) for marker in MARKERS))
HARMONY_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
RECIPIENT = re.compile(r"(?:^|\s|\|>)to=([^\s<]*)")  # a header's recipient: a tool's call
FUNCTIONS = "functions."  # a recipient's prefix for the request's tools (the others: built-ins)


class ReasoningStream(Protocol):
    """One choice's reply, fed piece by piece: each piece's (reasoning, content) text."""

    state: str  # "reasoning" while the text read is in the reply's thinking

    def feed(self, text: str, final: bool) -> tuple[str, str]: ...


def keeps_special_tokens(parser: str | None) -> bool:
    """Whether the parser reads special tokens, so its requests must not skip them."""
    return parser == HARMONY


def stream_for(parser: str) -> ReasoningStream:
    """A new stream of one reply, split by `parser`."""
    return HarmonyStream() if parser == HARMONY else ThinkStream(parser)


def split_reasoning(text: str, parser: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole reply; None where there is none."""
    if parser == HARMONY:
        reasoning, content = HarmonyStream().feed(text, final=True)
        return reasoning or None, content or None
    if parser == "qwen3" and (START not in text or END not in text):
        return None, text
    before, tag, after = text.partition(START)
    text = after if tag else before
    if END not in text:  # deepseek_r1: still thinking when the reply ended
        return text, None
    reasoning, _, content = text.partition(END)
    return reasoning, content or None


class ThinkStream:
    """A deepseek_r1 or qwen3 reply, fed piece by piece."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.state = "start"  # start (the opening tag may come), reasoning, content
        self.held = ""  # text that may be the start of the tag looked for

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        self.held += text
        reasoning = content = ""
        if self.state == "start":
            if self.held.startswith(START):
                self.held, self.state = self.held[len(START) :], "reasoning"
            elif START.startswith(self.held) and not final:
                return "", ""  # may still be the opening tag
            else:
                self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
        if self.state == "reasoning":
            before, tag, after = self.held.partition(END)
            if tag:
                reasoning, self.held, self.state = before, after, "content"
            else:
                cut = len(self.held) - (0 if final else _partial_tag(self.held, END))
                reasoning, self.held = self.held[:cut], self.held[cut:]
        if self.state == "content":
            content, self.held = self.held, ""
        return reasoning, content


class HarmonyStream:
    """An openai_gptoss reply (harmony messages), fed piece by piece: its reasoning and
    content, and (in `calls`) the tool calls it has written."""

    def __init__(self) -> None:
        # header (before a message's <|message|>), or the field of the message's text:
        # reasoning, content, call (a call of a function), or none (a built-in tool's call)
        self.state = "header"
        self.header = ""  # the open header's text, markers included
        self.held = ""  # text not read yet: it may be the start of a marker
        self.written: set[str] = set()  # the fields earlier messages wrote to
        self.opened = False  # whether the open message has written text yet
        self.function: str | None = None  # the function the open message calls
        self.arguments = ""  # the open call's text
        self.calls: list[tuple[str, str]] = []  # each call ended: (function, its text)

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        self.held += text
        out = {"reasoning": "", "content": ""}
        while found := MARKER.search(self.held):
            self.read(self.held[: found.start()], out)
            self.mark(found.group())
            self.held = self.held[found.end() :]
        cut = len(self.held) - _partial_marker(self.held, final)
        self.read(self.held[:cut], out)
        self.held = "" if final else self.held[cut:]  # at the end: a marker cut short
        if final and self.function is not None and _is_json(self.arguments):
            # a call the reply left open (its <|call|> not in the text) is kept if whole
            self.end_message()
        return out["reasoning"], out["content"]

    def read(self, text: str, out: dict[str, str]) -> None:
        """Text between markers: the header's, the open call's, or the open message's
        field's."""
        if self.state == "header":
            self.header += text
        elif self.state == "call":
            self.arguments += text
        elif self.state in out and text:
            if not self.opened and self.state in self.written:
                text = "\n" + text  # the field's next message
            self.opened = True
            self.written.add(self.state)
            out[self.state] += text

    def mark(self, marker: str) -> None:
        """A marker read: a message's end or a header's start opens the next header; the
        header's <|message|> opens its message; a header keeps its other markers."""
        if marker == MESSAGE_START or marker in MESSAGE_ENDS:
            self.end_message()
            self.state, self.header = "header", ""
        elif self.state != "header":
            return  # a stray marker inside a message
        elif marker == MESSAGE:
            self.state, self.opened = _harmony_field(self.header), False
            self.function, self.arguments = _function(self.header), ""
        else:
            self.header += marker

    def end_message(self) -> None:
        """The open message has ended: a function's call is kept."""
        if self.function is not None:
            self.calls.append((self.function, self.arguments))
        self.function, self.arguments = None, ""


def _harmony_field(header: str) -> str:
    """The field a harmony message's text goes to, by its header."""
    if RECIPIENT.search(header):
        return "call" if _function(header) is not None else "none"
    channel = HARMONY_CHANNEL.search(header)
    return "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"


def _function(header: str) -> str | None:
    """The function a harmony message calls (its recipient `functions.NAME`), if any."""
    recipient = RECIPIENT.search(header)
    if recipient is None or not recipient.group(1).startswith(FUNCTIONS):
        return None
    return recipient.group(1).removeprefix(FUNCTIONS) or None


def _is_json(text: str) -> bool:
    """Whether `text` is one whole JSON value."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _partial_marker(text: str, final: bool) -> int:
    """The length of the longest end of `text` that begins a harmony marker: held back, or at
    the reply's end dropped (a lone "<" is then text)."""
    size = max(_partial_tag(text, marker) for marker in MARKERS)
    return 0 if final and size < 2 else size


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: it may be it)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
