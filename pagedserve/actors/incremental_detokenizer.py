"""Incremental detokenization and stop strings, one `IncrementalDetokenizer` per request.

Decoding uses the prefix_offset / read_offset window: each step decodes only the tokens since
the last emission plus the previous emitted chunk as context, and emits the difference, so the
cost per token is O(1) in the output length. Text that ends in U+FFFD (a UTF-8 character
whose bytes are split across tokens) is held back until the character completes.

The output text is the text the output tokens add after the prompt, i.e.
`decode(prompt + output)[len(decode(prompt)):]`: the last prompt tokens are decoded as context,
so a SentencePiece word-start token keeps its leading space. With an empty prompt (and always
for byte-level BPE) this equals `decode(output)`. Decoding never applies HF's
`clean_up_tokenization_spaces` (it is not incremental).

Byte-level BPE (GPT-2, Llama 3, Qwen: a tokenizer whose decoder is exactly `ByteLevel`) takes a
fast path, `ByteLevelStream`: a token's bytes are a cached table lookup and an incremental
UTF-8 decoder holds back an incomplete character, with no call into the tokenizer per token
(when the prompt's text ends on a character boundary, as it nearly always does; else the
window). It streams exactly what `decode` gives (the tests check it against the Rust decoder).
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Callable
from typing import Any

import msgspec
import tokenizers

from pagedserve.actors.messages import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded as context for the first output tokens
MAX_CONTEXT_EXTENSION = 8  # extra prompt tokens to reach the start of a character

Decoder = Callable[[list[int]], str]


class DetokenizeResult(msgspec.Struct, frozen=True):
    """One update's text (a Struct: built for every token, and cheaper than a dataclass)."""

    text_delta: str  # new output text, safe to stream
    stop_string: str | None = None  # the stop string that matched (the request is finished)


class TokenDecoder:
    """Token ids -> text for one tokenizer: the Rust `tokenizers.Tokenizer` when the model has
    a tokenizer.json (fast to load: no transformers import), else an HF tokenizer's decode."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.special_ids = special_token_ids(tokenizer)
        self.byte_level = ByteLevelVocab.of(tokenizer, self.special_ids)

    @classmethod
    def load(cls, path: str) -> TokenDecoder:
        tokenizer_json = os.path.join(path, "tokenizer.json")
        if os.path.isfile(tokenizer_json):
            return cls(tokenizers.Tokenizer.from_file(tokenizer_json))
        from pagedserve.actors.chat import load_tokenizer

        return cls(load_tokenizer(path))

    def decoder(self, skip_special_tokens: bool) -> Decoder:
        tokenizer = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
        if isinstance(tokenizer, tokenizers.Tokenizer):
            return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return lambda ids: self.tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte alphabet, reversed: the character that stands for each byte -> the byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {byte: chr(byte) for byte in printable}
    for extra, byte in enumerate(b for b in range(256) if b not in chars):
        chars[byte] = chr(256 + extra)
    return {char: byte for byte, char in chars.items()}


BYTE_OF_CHAR = _byte_of_char()


class ByteLevelVocab:
    """The bytes of each token of a byte-level BPE tokenizer, looked up once and cached.

    As the Rust `ByteLevel` decoder does for every token it decodes, added tokens included: a
    token whose every character is in the byte alphabet is those bytes, any other token is its
    own UTF-8; the text is then the UTF-8 decoding (invalid bytes replaced) of all the bytes."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, special_ids: set[int]) -> None:
        self._tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}
        self._whole_texts: dict[int, str | None] = {}
        self.special_ids = special_ids

    @classmethod
    def of(cls, tokenizer: Any, special_ids: set[int]) -> ByteLevelVocab | None:
        """The vocabulary of a Rust tokenizer whose decoder is exactly ByteLevel, else None."""
        rust = getattr(tokenizer, "_tokenizer", tokenizer)
        if isinstance(rust, tokenizers.Tokenizer) and isinstance(
            rust.decoder, tokenizers.decoders.ByteLevel
        ):
            return cls(rust, special_ids)
        return None

    def bytes_of(self, token_id: int) -> bytes:
        cached = self._bytes.get(token_id)
        if cached is None:
            token = self._tokenizer.id_to_token(token_id) or ""  # an unknown id decodes to ""
            try:
                cached = bytes([BYTE_OF_CHAR[char] for char in token])
            except KeyError:
                cached = token.encode()
            self._bytes[token_id] = cached
        return cached

    def whole_text(self, token_id: int) -> str | None:
        """The token's text decoded from a character boundary when that leaves no incomplete
        character behind (most tokens), else None; looked up once."""
        try:
            return self._whole_texts[token_id]
        except KeyError:
            data = self.bytes_of(token_id)
            text, consumed = codecs.utf_8_decode(data, "replace", False)
            self._whole_texts[token_id] = text if consumed == len(data) else None
            return self._whole_texts[token_id]


def special_token_ids(tokenizer: Any) -> set[int]:
    """Every id that `skip_special_tokens=True` drops."""
    if isinstance(tokenizer, tokenizers.Tokenizer):
        added = tokenizer.get_added_tokens_decoder()
        return {i for i, token in added.items() if token.special}
    ids = set(tokenizer.all_special_ids)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(i for i, tok in added.items() if getattr(tok, "special", False))
    return ids


def prompt_context(
    decode: Decoder, prompt_ids: list[int], special_ids: set[int], skip_special_tokens: bool
) -> list[int]:
    """The last few prompt tokens that decode to text: the left context of the output.

    Starts on a character boundary (a context that begins inside a UTF-8 character decodes
    to U+FFFD, and byte-fallback decoders then garble the whole byte run)."""
    tail = prompt_ids[-4 * (PROMPT_CONTEXT_TOKENS + MAX_CONTEXT_EXTENSION) :]
    if skip_special_tokens:
        tail = [t for t in tail if t not in special_ids]
    start = max(len(tail) - PROMPT_CONTEXT_TOKENS, 0)
    for begin in range(start, max(start - MAX_CONTEXT_EXTENSION, 0) - 1, -1):
        if not decode(tail[begin:]).startswith(REPLACEMENT_CHAR):
            return tail[begin:]
    return tail[start:]


class TokenStream:
    """Token ids in, text deltas out, via a sliding decode window."""

    def __init__(self, decode: Decoder, context_ids: list[int]) -> None:
        self._decode = decode
        self._ids = list(context_ids)
        self._prefix = 0  # start of the decode window: the previous emitted chunk
        self._read = len(self._ids)  # end of the text emitted so far

    def push(self, new_ids: list[int], flush: bool) -> str:
        """Append tokens; return the text they complete (all pending text when `flush`)."""
        self._ids.extend(new_ids)
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text):
            return ""  # the new tokens add no text yet (e.g. skipped special tokens)
        if new_text.endswith(REPLACEMENT_CHAR) and not flush:
            return ""  # an incomplete UTF-8 character: wait for its remaining bytes
        self._advance()
        return new_text[len(prefix_text) :]

    def _advance(self) -> None:
        """Slide the window and forget ids before it, keeping the list short."""
        del self._ids[: self._read]
        self._prefix, self._read = 0, len(self._ids)


class ByteLevelStream:
    """Token ids in, text deltas out, for byte-level BPE: table lookups and an incremental
    UTF-8 decoder (which holds back an incomplete character and replaces invalid bytes as
    `decode` does). Starts on a character boundary: the output's text is decode(output)."""

    def __init__(self, vocab: ByteLevelVocab, skip_special_tokens: bool) -> None:
        self._vocab = vocab
        self._skipped = vocab.special_ids if skip_special_tokens else set()
        self._pending = b""  # the bytes of an incomplete character

    def push(self, new_ids: list[int], flush: bool) -> str:
        """Append tokens; return the text they complete (all pending text when `flush`).
        One token after a character boundary is a cached lookup (the common step)."""
        if len(new_ids) == 1 and not self._pending:
            token_id = new_ids[0]
            if token_id in self._skipped:
                return ""
            text = self._vocab.whole_text(token_id)
            if text is not None:
                return text
        return self._decode(new_ids, flush)

    def _decode(self, new_ids: list[int], flush: bool) -> str:
        """The incremental UTF-8 decoding of the pending bytes and those of `new_ids`."""
        vocab, skipped = self._vocab, self._skipped
        data = self._pending + b"".join([vocab.bytes_of(t) for t in new_ids if t not in skipped])
        text, consumed = codecs.utf_8_decode(data, "replace", flush)
        self._pending = data[consumed:]
        return text


class StopStringMatcher:
    """Finds stop strings in streamed text and holds back text that may start one."""

    def __init__(self, stops: list[str], include_stop: bool) -> None:
        self._stops = stops
        self._include = include_stop
        self._prefixes = {s[:k] for s in stops for k in range(1, len(s))}
        self._max_hold = max((len(s) for s in stops), default=1) - 1
        self._firsts = {s[0] for s in stops if len(s) > 1}  # where a held suffix starts
        self._starts = {s[0] for s in stops}  # where any match starts
        self._pending = ""  # decoded text not yet emitted

    def feed(self, text: str, flush: bool) -> tuple[str, str | None]:
        """Add decoded text; return (text safe to emit, matched stop string or None)."""
        buf = self._pending + text
        if self._starts.isdisjoint(buf):
            return buf, None  # no match and nothing to hold can start in it (so none pending)
        match = self._find(buf)
        if match is not None:
            idx, stop = match
            self._pending = ""
            return buf[: idx + len(stop) if self._include else idx], stop
        hold = 0 if flush else self._hold_length(buf)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], None

    def _find(self, buf: str) -> tuple[int, str] | None:
        """The earliest stop string occurrence (first listed wins a tie)."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            idx = buf.find(stop)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        return best

    def _hold_length(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        tail = buf[-self._max_hold :]  # (all of buf when _max_hold is 0, but then no _firsts)
        if self._firsts.isdisjoint(tail):
            return 0  # no stop string can start in the last characters (the common case)
        for k in range(min(len(buf), self._max_hold), 0, -1):
            if buf[-k:] in self._prefixes:
                return k
        return 0


class IncrementalDetokenizer:
    """Streams a request's output text: UTF-8 safe, O(1) per token, stop-string aware."""

    def __init__(
        self, decoder: TokenDecoder, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> None:
        self._stream = self._token_stream(decoder, prompt_token_ids, sampling.skip_special_tokens)
        stops = sampling.stop_strings
        self._matcher = None
        if stops:
            self._matcher = StopStringMatcher(stops, sampling.include_stop_str_in_output)
        self._done = False

    @staticmethod
    def _token_stream(
        decoder: TokenDecoder, prompt_token_ids: list[int], skip: bool
    ) -> TokenStream | ByteLevelStream:
        """The byte-level fast path when the prompt's text ends on a character boundary (its
        last tokens' text does not end in U+FFFD), else the decode window."""
        decode = decoder.decoder(skip)
        tail = prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
        if decoder.byte_level is not None and not decode(tail).endswith(REPLACEMENT_CHAR):
            return ByteLevelStream(decoder.byte_level, skip)
        special = decoder.special_ids if skip else set()
        return TokenStream(decode, prompt_context(decode, prompt_token_ids, special, skip))

    def update(self, new_token_ids: list[int], finished: bool) -> DetokenizeResult:
        """Add sampled tokens; `finished` flushes held-back text (the request ended)."""
        if self._done:
            return DetokenizeResult("")
        text = self._stream.push(new_token_ids, flush=finished)
        self._done = finished
        if self._matcher is None:
            return DetokenizeResult(text)
        delta, stop = self._matcher.feed(text, flush=finished)
        self._done = finished or stop is not None
        return DetokenizeResult(delta, stop)
