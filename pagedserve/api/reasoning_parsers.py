"""vLLM's reasoning parsers (`serve --reasoning-parser`): a reply's thinking, written between
`<think>` and `</think>`, goes to the message's `reasoning_content`, the rest to `content`.

  deepseek_r1  the reply starts in thinking (the chat template opened it): everything up to
               `</think>` is reasoning (a `<think>` the model writes itself is dropped); a
               reply that never closes it is all reasoning.
  qwen3        only a reply holding both tags has reasoning: what lies between them; any
               other reply is content.

Streamed, text goes out as soon as no tag can be forming in it: a possible start of a tag is
held back until the next piece tells (or the reply ends). A streamed qwen3 reply that opens
`<think>` is reasoning until `</think>` comes, as in vLLM (it cannot wait to see the close).
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def split_reasoning(text: str, parser: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole reply; None where there is none."""
    if parser == "qwen3" and (START not in text or END not in text):
        return None, text
    before, tag, after = text.partition(START)
    text = after if tag else before
    if END not in text:  # deepseek_r1: still thinking when the reply ended
        return text, None
    reasoning, _, content = text.partition(END)
    return reasoning, content or None


class ReasoningStream:
    """One choice's reply, fed piece by piece: each piece's (reasoning, content) text."""

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


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: it may be it)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
