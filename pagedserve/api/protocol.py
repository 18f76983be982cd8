"""OpenAI request bodies as msgspec Structs (decoding is validation), and their mapping to
`SamplingParams`. Unknown fields are ignored, wrong types are a 400, as with OpenAI."""

from __future__ import annotations

import msgspec

from pagedserve.actors.messages import SamplingParams


class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str = ""


class ChatMessageIn(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if part.type == "text")


class _SamplingFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError (a 400) for values out of range."""
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[str | int | list[int]]  # text, texts, token ids, or lists of ids
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(t, int) for t in p):
            return [list(p)]  # type: ignore[arg-type]
        if all(isinstance(t, str) for t in p) or all(isinstance(t, list) for t in p):
            return list(p)  # type: ignore[arg-type]
        raise ValueError("prompt must be a string, a list of strings, token ids or id lists")

    def to_sampling(self) -> SamplingParams:
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be between 0 and 20")
        return self.sampling(16 if self.max_tokens is None else self.max_tokens, self.logprobs)


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def to_sampling(self) -> SamplingParams:
        if not self.messages:
            raise ValueError("messages must not be empty")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise ValueError("top_logprobs must be between 0 and 20")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        limit = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        return self.sampling(limit, logprobs)


def decode_body(body: bytes, kind: type[msgspec.Struct]) -> msgspec.Struct:
    """Raises ValueError with a readable message for malformed JSON or wrong types."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed JSON body: {exc}") from None
