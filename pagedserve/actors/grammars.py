"""Grammars of constrained decoding, with llguidance: what a request's `StructuredOutputsParams`
compiles to, its validation (the tokenizer actor refuses a bad one with a 400 before the
request is scheduled) and the llguidance view of the model's tokenizer (the workers' matchers
and the validation share it).

JSON is generated in one layout: `", "` between items, `": "` after keys, no other whitespace
(`JSON_LAYOUT`). Free whitespace lets a model pad its output with blanks until max_tokens;
this layout is json.dumps' own, so the output is also what most models saw in training.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from pagedserve.actors.messages import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = '{"type": "object"}'


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (serialized) of `params`; ValueError when it is not JSON where
    JSON is needed. Whether the grammar is valid is `GrammarChecker`'s question."""
    from llguidance import LLMatcher, grammar_from

    if params.structural_tag is not None:
        return structural_tag_grammar(params.structural_tag)  # type: ignore[arg-type]
    if params.grammar is not None:
        try:  # Lark as it is; GBNF (`root ::= ...`) translated to Lark
            return grammar_from("grammar", params.grammar)
        except Exception as exc:  # llguidance's GBNF translation raises its own errors
            raise ValueError(f"invalid structured output specification: {exc}") from None
    if params.choice:
        return LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, params.choice)))
    if params.regex is not None:
        return LLMatcher.grammar_from_regex(params.regex)
    schema = params.json if isinstance(params.json, str) else ANY_JSON_OBJECT
    try:
        json.loads(schema)
    except ValueError:
        raise ValueError("the JSON schema is not valid JSON") from None
    return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)  # type: ignore[arg-type]


def structural_tag_grammar(text: str) -> str:
    """vLLM's structural tags as llguidance reads them: each structure's trigger is the first
    of `triggers` its `begin` starts with; its `schema` (JSON schema, in JSON_LAYOUT, or a Lark
    grammar) holds between `begin` and `end`, and the text around the structures is free."""
    from llguidance import StructTag

    try:
        spec = json.loads(text)
        triggers = [str(t) for t in spec["triggers"]]
        tags = []
        for structure in spec["structures"]:
            begin = str(structure["begin"])
            trigger = next((t for t in triggers if t and begin.startswith(t)), None)
            if trigger is None:
                raise ValueError(f"no trigger starts the structure {begin!r}")
            schema = structure["schema"]
            if isinstance(schema, str) and "start:" not in schema:  # JSON schema text, not Lark
                schema = json.loads(schema)
            if isinstance(schema, dict):  # the JSON layout of every schema here
                schema = {"x-guidance": JSON_LAYOUT, **schema}
            tags.append(
                StructTag(trigger=trigger, begin=begin, grammar=schema, end=structure["end"])
            )
        if not tags:
            raise ValueError("no structures")
        return StructTag.to_grammar(tags)
    except Exception as exc:  # malformed JSON or structures, or llguidance's own errors
        raise ValueError(
            f"invalid structured output specification: structural_tag: {exc}"
        ) from None


def load_ll_tokenizer(
    tokenizer_path: str, vocab_size: int, eos_token_ids: list[int]
) -> llguidance.LLTokenizer:
    """llguidance's tokenizer over the model's vocabulary (`vocab_size`: the logits' width;
    more when the tokenizer has more entries), from tokenizer.json when there is one (no
    transformers import), else the HF tokenizer. ValueError when the tokenizer cannot be used
    (not a fast tokenizer)."""
    import llguidance

    eos = eos_token_ids or None
    tokenizer_json = os.path.join(tokenizer_path, "tokenizer.json")
    if os.path.isfile(tokenizer_json):
        import tokenizers

        tokenizer = tokenizers.Tokenizer.from_file(tokenizer_json)
        size = max(vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))
        return llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=size, eos_token=eos)
    import llguidance.hf

    from pagedserve.actors.chat import load_tokenizer

    hf_tokenizer = load_tokenizer(tokenizer_path)
    size = max(vocab_size, len(hf_tokenizer))
    return llguidance.hf.from_tokenizer(hf_tokenizer, size, eos)


class GrammarChecker:
    """Validates grammars against the tokenizer, remembering the last `capacity` verdicts by
    the grammar's digest. Thread-safe (the tokenizer actor validates in worker threads)."""

    def __init__(
        self, tokenizer_path: str, vocab_size: int, eos_token_ids: list[int], capacity: int = 256
    ) -> None:
        self.tokenizer_args = (tokenizer_path, vocab_size, eos_token_ids)
        self.capacity = capacity
        self.tokenizer: llguidance.LLTokenizer | None = None  # built at the first grammar
        self.tokenizer_error = ""  # why it could not be built
        self.errors: OrderedDict[bytes, str] = OrderedDict()
        self.lock = threading.Lock()

    def check(self, params: StructuredOutputsParams) -> None:
        """ValueError (a 400 for the client) when `params` cannot constrain this model."""
        text = grammar_text(params)
        key = hashlib.sha256(text.encode()).digest()
        with self.lock:
            error = self.errors.get(key)
            if error is None:
                error = self._validate(text)
                self.errors[key] = error
                if len(self.errors) > self.capacity:
                    self.errors.popitem(last=False)
            self.errors.move_to_end(key)
        if error:
            raise ValueError(f"invalid structured output specification: {error}")

    def _validate(self, text: str) -> str:
        from llguidance import LLMatcher

        if self.tokenizer is None and not self.tokenizer_error:
            try:
                self.tokenizer = load_ll_tokenizer(*self.tokenizer_args)
            except Exception as exc:  # llguidance takes fast (Rust) tokenizers only
                self.tokenizer_error = f"this model's tokenizer does not support it ({exc})"
        return self.tokenizer_error or LLMatcher.validate_grammar(text, self.tokenizer)
