"""OpenAI request bodies as msgspec Structs (decoding is validation), their limits, and their
mapping to `SamplingParams` (and `PoolingParams`; for a score or rerank body, the pairs it
scores). Unknown fields are ignored and wrong types are a 400, as with OpenAI; a known field
that would change the output but is not implemented is a 400 too, never silently ignored.
Every check here raises ValueError, which the server answers with a 400."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

import msgspec

from pagedserve.actors.chat import check_prompt_options
from pagedserve.actors.messages import (
    ChatMessage,
    PoolingParams,
    PromptOptions,
    SamplingParams,
    StructuredOutputsParams,
)
from pagedserve.actors.pooling_params import pooling_sampling
from pagedserve.api.beam_search import BeamSearchParams
from pagedserve.api.client_core import Prompt
from pagedserve.api.scoring import ScorePlan, plan_scores
from pagedserve.api.structured import StructuredOutputFields
from pagedserve.api.tools import Tool, ToolPlan, plan_tools
from pagedserve.config import ServerConfig

Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]  # what the engine can hold
TokenPrompt = list[int]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage in every chunk


class ContentPart(msgspec.Struct):
    type: str
    text: str = ""


class ChatMessageIn(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: the call it answers

    def to_wire(self) -> ChatMessage:
        return ChatMessage(self.role, self.text(), self.tool_calls, self.tool_call_id)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"content parts of type {part.type!r} are not supported")
        return "".join(part.text for part in self.content)


class _SamplingFields(StructuredOutputFields, kw_only=True):
    model: str | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    n: Int64 = 1
    best_of: Int64 | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: Int64 | None = None  # vLLM's: top logprobs per prompt token
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias, clamped to +-100
    # vLLM's extra fields
    truncate_prompt_tokens: Int64 | None = None  # the prompt's last k tokens (-1: what fits)
    allowed_token_ids: list[Int64] | None = None  # sample only among these
    bad_words: list[str] | None = None  # words the output must not contain
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:{id}"
    return_token_ids: bool = False  # each choice's token ids (and the prompt's) in the answer
    use_beam_search: bool = False  # vLLM's: n beams (api/beam_search.py)
    length_penalty: float = 1.0  # beam search's
    priority: Int64 = 0
    # vLLM's, not implemented: a 400 when they would change the output
    logits_processors: list[Any] | None = None
    guided_whitespace_pattern: str | None = None

    def check_supported(self) -> None:
        if self.best_of is not None and self.best_of not in (1, self.n):
            raise ValueError("best_of other than n is not supported")
        if self.stream and self.prompt_logprobs:  # as vLLM
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        unsupported = {
            "logits_processors": bool(self.logits_processors),
            "guided_whitespace_pattern": self.guided_whitespace_pattern is not None,
        }
        for name, asked in unsupported.items():
            if asked:
                raise ValueError(f"{name} is not supported")

    def beam_search_params(
        self, sampling: SamplingParams, max_model_len: int
    ) -> BeamSearchParams | None:
        """With use_beam_search, the search of `sampling`'s n beams (its temperature and
        max_tokens resolved as for sampling; none: until the beams fill max_model_len).
        The fields a beam search cannot honour are a 400, as is length_penalty without it."""
        if not self.use_beam_search:
            if self.length_penalty != 1.0:
                raise ValueError("length_penalty applies to beam search only (use_beam_search)")
            return None
        conflicts = [name for name, asked in self.beam_search_conflicts().items() if asked]
        if conflicts:
            raise ValueError(f"use_beam_search does not take {', '.join(conflicts)}")
        return BeamSearchParams(
            beam_width=sampling.n,
            max_tokens=max_model_len if sampling.max_tokens is None else sampling.max_tokens,
            ignore_eos=sampling.ignore_eos,
            temperature=sampling.temperature,
            length_penalty=self.length_penalty,
            include_stop_str_in_output=sampling.include_stop_str_in_output,
        )

    def beam_search_conflicts(self) -> dict[str, bool]:
        """The fields asked for that a beam search would not follow (each step is a new
        request of one token ranked by raw logprobs: no output history, no filters)."""
        return {
            "stop": bool(self.stop),
            "stop_token_ids": bool(self.stop_token_ids),
            "bad_words": bool(self.bad_words),
            "min_tokens": self.min_tokens > 0,
            "top_p": self.top_p not in (None, 1.0),
            "top_k": self.top_k not in (None, 0, -1),
            "min_p": self.min_p not in (None, 0.0),
            "presence_penalty": self.presence_penalty not in (None, 0.0),
            "frequency_penalty": self.frequency_penalty not in (None, 0.0),
            "repetition_penalty": self.repetition_penalty not in (None, 1.0),
            "logit_bias": bool(self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids is not None,
            "prompt_logprobs": self.prompt_logprobs is not None,
            "structured outputs": self.structured_output_params() is not None,
        }

    def check_limits(self, limits: ServerConfig) -> None:
        for name, value in (("n", self.n), ("best_of", self.best_of)):
            if value is not None and value > limits.max_n:
                raise ValueError(f"{name} must be at most {limits.max_n}, got {value}")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > limits.max_stop_strings:
            raise ValueError(f"stop takes at most {limits.max_stop_strings} strings")
        if any(len(s) > limits.max_stop_string_chars for s in stops):
            raise ValueError(f"a stop string is at most {limits.max_stop_string_chars} characters")
        if len(self.stop_token_ids or []) > limits.max_stop_token_ids:
            raise ValueError(f"stop_token_ids takes at most {limits.max_stop_token_ids} ids")
        if len(self.bad_words or []) > limits.max_bad_words:
            raise ValueError(f"bad_words takes at most {limits.max_bad_words} words")
        if any(len(w) > limits.max_stop_string_chars for w in self.bad_words or []):
            raise ValueError(f"a bad word is at most {limits.max_stop_string_chars} characters")

    def sampling(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        defaults: dict[str, Any],
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """`defaults` (the model's generation config) fill the fields the request leaves
        unset; its max_tokens is also an upper bound, as in vLLM."""

        def pick(name: str, fallback: float) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        limit = defaults.get("max_tokens")
        if limit is not None:
            max_tokens = limit if max_tokens is None else min(max_tokens, limit)
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured_output_params(),
            prompt_logprobs=prompt_logprobs,
            logit_bias=self.token_biases(),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
        )

    def token_biases(self) -> dict[int, float] | None:
        """logit_bias with int keys and each bias clamped to [-100, 100] (OpenAI's range, as
        vLLM does); a key that is not a token id is a ValueError (a 400)."""
        if not self.logit_bias:
            return None
        biases = {}
        for key, bias in self.logit_bias.items():
            if not key.strip().isdecimal():  # what int() reads: "²" is a digit, not decimal
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            biases[int(key)] = min(100.0, max(-100.0, bias))
        return biases

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Every stream chunk carries its choice's usage so far (vLLM's)."""
        return self.include_usage and self.stream_options.continuous_usage_stats  # type: ignore[union-attr]


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[str | Int64 | list[Int64]]  # text, texts, token ids, or lists of ids
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's own (BOS...) around the text
    prompt_embeds: Any = None  # vLLM's, not supported

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.prompt_embeds is not None:
            raise ValueError("prompt_embeds are not supported")

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) only, as vLLM answers; the
        engine samples one token, which the answer leaves out."""
        return self.echo and self.max_tokens == 0

    def prompt_options(self) -> PromptOptions:
        return PromptOptions(add_special_tokens=self.add_special_tokens)

    def prompts(self, limits: ServerConfig) -> list[str | TokenPrompt]:
        return prompt_list(self.prompt, "prompt", limits)

    def to_sampling(self, defaults: dict[str, Any]) -> SamplingParams:
        if self.logprobs is not None and self.logprobs < 0:  # the most: --max-logprobs
            raise ValueError("logprobs must be non-negative")
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:  # the echoed prompt's logprobs, as vLLM
            prompt_logprobs = self.logprobs
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        if self.echo_only:
            max_tokens = 1
        return self.sampling(max_tokens, self.logprobs, defaults, prompt_logprobs)


ReasoningEffort = Literal["low", "medium", "high"]
REASONING_EFFORTS = get_args(ReasoningEffort)


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessageIn]
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True
    # vLLM's chat fields (PromptOptions)
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # the template writes the special tokens it wants
    tools: list[Tool] | None = None  # with tool_choice: see api/tools.py
    tool_choice: Any = None
    echo: bool = False  # vLLM's: a final assistant message's content before the reply
    # OpenAI's: how long to reason, a chat template variable (GPT-OSS's), as vLLM passes it
    reasoning_effort: ReasoningEffort | None = None
    # Not implemented: a 400 when asked for
    functions: list[Any] | None = None
    function_call: Any = None
    chat_template: str | None = None
    documents: list[Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        self.tool_plan()
        if self.functions or self.function_call not in (None, "none"):
            raise ValueError("functions / function_call (tool calling) are not supported")
        if self.chat_template is not None:
            raise ValueError("a per-request chat_template is not supported (see --chat-template)")
        if self.documents:
            raise ValueError("documents are not supported")
        check_prompt_options(self.prompt_options())

    def echoed(self) -> str:
        """What `echo` puts before the reply: the last message's content when it is the
        assistant's (the message the reply continues), else nothing (vLLM's rule)."""
        if not self.echo or not self.messages or self.messages[-1].role != "assistant":
            return ""
        return self.messages[-1].text()

    def prompt_options(self) -> PromptOptions:
        tools = [msgspec.to_builtins(t) for t in self.tools] if self.tools else None
        return template_options(self, tools, self.reasoning_effort)

    def tool_plan(self) -> ToolPlan | None:
        return plan_tools(self.tools, self.tool_choice)

    @property
    def wants_auto_tools(self) -> bool:
        """tool_choice "auto", asked for or the default with tools (a parser's work)."""
        return self.tool_choice == "auto" or bool(self.tools and self.tool_choice is None)

    def structured_output_params(self) -> StructuredOutputsParams | None:
        """A tool choice's constraint, or the structured output asked for (not both)."""
        asked, plan = super().structured_output_params(), self.tool_plan()
        if plan is None:
            return asked
        if asked is not None:
            raise ValueError("tool_choice excludes response_format and the other constraints")
        return plan.constraint

    def chat_messages(self, limits: ServerConfig) -> list[ChatMessage]:
        return chat_messages(self.messages, limits)

    def to_sampling(self, defaults: dict[str, Any]) -> SamplingParams:
        if self.top_logprobs is not None and self.top_logprobs < 0:  # the most: --max-logprobs
            raise ValueError("top_logprobs must be non-negative")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        limit = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        return self.sampling(limit, logprobs, defaults, self.prompt_logprobs)


class _PoolingFields(msgspec.Struct, kw_only=True):
    """The fields of every body answered with embeddings (vLLM's names)."""

    model: str | None = None
    truncate_prompt_tokens: Int64 | None = None  # each text's last k tokens (-1: what fits)
    priority: Int64 = 0

    def to_sampling(self) -> SamplingParams:
        return pooling_sampling(self.truncate_prompt_tokens)


class EmbeddingRequest(_PoolingFields, kw_only=True):
    """OpenAI's /v1/embeddings body, with vLLM's extra fields (add_special_tokens,
    truncate_prompt_tokens, priority), or vLLM's chat form (EmbeddingChatRequest): `messages`
    instead of `input`, one embedding of the conversation through the chat template, with
    vLLM's chat fields (whose defaults differ from chat completions': no generation prompt).
    `user` is accepted and ignored."""

    input: str | list[str | Int64 | list[Int64]] | None = None  # text(s), token ids, id lists
    messages: list[ChatMessageIn] | None = None
    encoding_format: str = "float"  # or "base64": little-endian float32 bytes, base64
    dimensions: Int64 | None = None  # the first that many values (Matryoshka embeddings)
    user: str | None = None
    add_special_tokens: bool | None = None  # None: yes for input, no for messages
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's, not supported: a 400

    def check_supported(self) -> None:
        if self.encoding_format not in ("float", "base64"):
            raise ValueError(
                f"encoding_format must be float or base64, not {self.encoding_format!r}"
            )
        if self.chat_template is not None:
            raise ValueError("a per-request chat_template is not supported (see --chat-template)")
        if self.messages is not None:
            check_prompt_options(self.prompt_options())

    def prompts(self, limits: ServerConfig) -> list[Prompt]:
        """The inputs, or the one conversation of `messages` (one or the other)."""
        if self.input is not None and self.messages is None:
            return prompt_list(self.input, "input", limits)  # type: ignore[return-value]
        if self.messages is not None and self.input is None:
            return [chat_messages(self.messages, limits)]
        raise ValueError("give either input or messages")

    def prompt_options(self) -> PromptOptions:
        return template_options(self)

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(dimensions=self.dimensions)


class ClassificationRequest(_PoolingFields, kw_only=True):
    """vLLM's /classify body: `input`, a text, texts, token ids or lists of them, each
    classified by a sequence classifier, with vLLM's add_special_tokens, truncate_prompt_tokens
    and priority. `user` is accepted and ignored."""

    input: str | list[str | Int64 | list[Int64]]
    user: str | None = None
    add_special_tokens: bool | None = None  # None: yes

    def prompts(self, limits: ServerConfig) -> list[Prompt]:
        return prompt_list(self.input, "input", limits)  # type: ignore[return-value]

    def prompt_options(self) -> PromptOptions:
        return PromptOptions(add_special_tokens=self.add_special_tokens)

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(task="classify")


class ScoreRequest(_PoolingFields, kw_only=True):
    """vLLM's /score body: text_1 against each text of text_2 (1 -> N), or the two lists
    pair by pair (N -> N)."""

    text_1: str | list[str]
    text_2: str | list[str]

    def plan(self, limits: ServerConfig, hf_config: dict[str, Any]) -> ScorePlan:
        texts = (self.text_1, self.text_2)
        return plan_text_pairs(texts, ("text_1", "text_2"), limits, hf_config)


class RerankRequest(_PoolingFields, kw_only=True):
    """vLLM's /rerank body (Jina's and Cohere's shape): the documents ranked by their score
    against the query, the best `top_n` (vLLM's: 0, the default, keeps them all)."""

    query: str
    documents: list[str]
    top_n: Int64 = 0

    def plan(self, limits: ServerConfig, hf_config: dict[str, Any]) -> ScorePlan:
        if self.top_n < 0:
            raise ValueError(f"top_n must be at least 0 (0: every document), got {self.top_n}")
        texts = (self.query, self.documents)
        return plan_text_pairs(texts, ("query", "documents"), limits, hf_config)


def plan_text_pairs(
    texts: tuple[str | list[str], str | list[str]],
    names: tuple[str, str],
    limits: ServerConfig,
    hf_config: dict[str, Any],
) -> ScorePlan:
    """What to pool and the pairs to score (api/scoring.py: by the model of `hf_config`),
    within the limits on an embeddings body's inputs: each text's length, and as many texts
    in all as prompts in one body."""
    texts_1, texts_2 = ([text] if isinstance(text, str) else text for text in texts)
    if len(texts_1) + len(texts_2) > limits.max_prompts_per_request:
        raise ValueError(
            f"at most {limits.max_prompts_per_request} texts per request "
            f"({names[0]} and {names[1]} together)"
        )
    if any(len(text) > limits.max_prompt_chars for text in texts_1 + texts_2):
        raise ValueError(f"a text is at most {limits.max_prompt_chars} characters")
    return plan_scores(texts_1, texts_2, names, hf_config)  # type: ignore[arg-type]


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize: a prompt (TokenizeCompletionRequest) or messages (TokenizeChatRequest)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def prompt_options(self) -> PromptOptions:
        """As the engine's tokenizer makes the ids of the same prompt or messages."""
        return template_options(self)


def template_options(
    body: ChatCompletionRequest | TokenizeRequest | EmbeddingRequest,
    tools: list[dict] | None = None,
    reasoning_effort: str | None = None,
) -> PromptOptions:
    """The chat template fields the bodies with messages share, as the tokenizer takes them (a
    chat's reasoning_effort among the template's variables)."""
    kwargs = body.chat_template_kwargs or {}
    if reasoning_effort is not None:  # chat_template_kwargs' own reasoning_effort wins
        kwargs = {"reasoning_effort": reasoning_effort} | kwargs
    return PromptOptions(
        add_special_tokens=body.add_special_tokens,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template_kwargs=kwargs,
        tools=tools,
    )


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[Int64]


def chat_messages(messages: list[ChatMessageIn], limits: ServerConfig) -> list[ChatMessage]:
    if not messages:
        raise ValueError("messages must not be empty")
    wire = [m.to_wire() for m in messages]
    if sum(len(m.content) for m in wire) > limits.max_prompt_chars:
        raise ValueError(f"the messages are at most {limits.max_prompt_chars} characters")
    return wire


def prompt_list(
    value: str | list[str | int | list[int]], name: str, limits: ServerConfig
) -> list[str | TokenPrompt]:
    """A body's prompts (its field `name`): one text, texts, token ids or lists of ids."""
    if isinstance(value, str):
        prompts: list[str | TokenPrompt] = [value]
    elif not value:
        raise ValueError(f"{name} must not be empty")
    elif all(isinstance(t, int) for t in value):
        prompts = [list(value)]  # type: ignore[arg-type]
    elif all(isinstance(t, str) for t in value) or all(isinstance(t, list) for t in value):
        prompts = list(value)  # type: ignore[arg-type]
    else:
        raise ValueError(f"{name} must be a string, a list of strings, token ids or id lists")
    if len(prompts) > limits.max_prompts_per_request:
        raise ValueError(f"at most {limits.max_prompts_per_request} prompts per request")
    for prompt in prompts:
        if isinstance(prompt, str) and len(prompt) > limits.max_prompt_chars:
            raise ValueError(f"a prompt is at most {limits.max_prompt_chars} characters")
    return prompts


def check_token_prompt(
    prompt: TokenPrompt, vocab_size: int, max_model_len: int, room: int = 1
) -> None:
    """A prompt given as token ids, checked before anything is queued: it leaves `room`
    tokens for output (an embedding has none)."""
    if not prompt:
        raise ValueError("a prompt of token ids must not be empty")
    if any(not 0 <= t < vocab_size for t in prompt):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    if len(prompt) + room > max_model_len:
        rest = ", which leaves no room for output" if room else ""
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{len(prompt)} tokens{rest}."
        )
