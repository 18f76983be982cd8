"""SamplingParams, part of the wire schema (messages.py re-exports it): a request's sampling
parameters, vLLM's names and defaults, checked when built (a ValueError is a 400 at the API).
Rules as in messages.py: add fields only at the end."""

from __future__ import annotations

import json
import math

import msgspec


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Constrained decoding, vLLM's: one of a JSON schema (its text; a dict becomes text), any
    JSON object, a regex, strings to choose from, a context-free grammar (Lark, or llama.cpp's
    GBNF, as vLLM's guidance backend reads it) or structural tags (JSON text, a dict becomes
    text: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}, free text in which
    each structure, once its trigger appears, follows its schema). The output ends when it is
    complete."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict | None = None

    def __post_init__(self) -> None:
        self.json = json.dumps(self.json) if isinstance(self.json, dict) else self.json
        tag = self.structural_tag
        self.structural_tag = json.dumps(tag) if isinstance(tag, dict) else tag
        given = (self.json, self.json_object or None, self.regex, self.choice or None)
        if (*given, self.grammar, self.structural_tag).count(None) != 5:
            raise ValueError(
                "structured outputs take one of json, json_object, regex, choice, grammar, "
                "structural_tag"
            )


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Sampling parameters; field names and defaults follow vLLM's public `SamplingParams`."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per output token (0: sampled only)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding
    prompt_logprobs: int | None = None  # top logprobs per prompt token (0: the token's own)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    # the prompt's last k tokens only (left truncation); -1: as many as leave room for one
    # output token within the model's length
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None  # sample only among these tokens
    # words the output must not contain (vLLM's: as token sequences, each word with and without
    # a leading space); their ids, filled in by the tokenizer actor (or given, without a
    # tokenizer), are what the worker bans: a sequence's last token where the output so far
    # ends with the rest of it
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        self._check_representable()
        self._check_sampling_ranges()
        self._check_lengths()
        self._check_token_lists()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0

    def _check_representable(self) -> None:
        """Integers the engine keeps in int64 arrays, floats it computes with: anything that
        cannot be represented is a ValueError here (a 400 at the API), never a crash later."""
        integers = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
        stop_ids = [("stop_token_ids", t) for t in self.stop_token_ids or []]
        for name, value in [*((n, getattr(self, n)) for n in integers), *stop_ids]:
            if value is not None and not -(2**63) <= value < 2**63:
                raise ValueError(f"{name} must be a 64-bit integer, got {value}")
        for token, bias in (self.logit_bias or {}).items():
            if not 0 <= token < 2**63:
                raise ValueError(f"logit_bias keys must be token ids, got {token}")
            if not math.isfinite(bias):
                raise ValueError("logit_bias values must be finite numbers")
        penalties = ("presence_penalty", "frequency_penalty", "repetition_penalty")
        for name in ("temperature", "top_p", "min_p", *penalties):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")

    def _check_sampling_ranges(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.seed is not None and self.seed + self.n - 1 >= 2**63:
            raise ValueError("seed + n - 1 must be a 64-bit integer (choice i uses seed + i)")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(
                f"top_k must be -1 (disable), 0 (disable) or positive, got {self.top_k}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError("presence_penalty must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError("frequency_penalty must be in [-2, 2]")
        if self.repetition_penalty <= 0.0:
            raise ValueError("repetition_penalty must be positive")

    def _check_lengths(self) -> None:
        """Output and prompt lengths, and how many logprobs (the most: the engine's
        max_logprobs, checked by the tokenizer actor)."""
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be at most max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        truncate = self.truncate_prompt_tokens
        if truncate is not None and not (truncate == -1 or 1 <= truncate < 2**63):
            raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {truncate}")
        for name, value in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be non-negative, got {value}")

    def _check_token_lists(self) -> None:
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            if any(not 0 <= t < 2**63 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be token ids")
        if any(not word.strip() for word in self.bad_words or []):
            raise ValueError("bad_words must be words, not empty or blank strings")
        for ids in self.bad_words_token_ids or []:
            if not ids or any(not 0 <= t < 2**63 for t in ids):
                raise ValueError("bad_words_token_ids must be non-empty lists of token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def stop_strings(self) -> list[str]:
        return [s for s in (self.stop or []) if s]  # type: ignore[union-attr]
