"""OpenAI response JSON: whole responses and stream chunks for completions and chat; the
answers made of pooled vectors (embeddings, vLLM's score, rerank and classify)."""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import msgspec

from pagedserve.actors.messages import RequestDelta, TokenLogprobs
from pagedserve.api.classification import Classifier
from pagedserve.api.client_core import Prompt
from pagedserve.api.generation import Choice, Event
from pagedserve.api.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from pagedserve.api.reasoning_parsers import ReasoningStream, split_reasoning, stream_for
from pagedserve.api.scoring import ScorePlan
from pagedserve.api.tool_parsers import PARSERS, ToolCallStream, parse_tool_calls, reads_harmony
from pagedserve.api.tools import new_call_id
from pagedserve.outputs import embedding_floats, logprob_dict

if TYPE_CHECKING:
    from pagedserve.api.openai_server import OpenAIServer

Scored = tuple[int, TokenLogprobs | None]  # a token id and its logprobs (None: has none)
MIN_LOGPROB = -9999.0  # what JSON gets for -inf (a token a grammar masks), as in vLLM


async def _after(first: Event | None, rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    if first is not None:
        yield first
    async for event in rest:
        yield event


def usage_of(prompt: int, completion: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class Render:
    """Turns choices into OpenAI JSON: whole responses and stream chunks."""

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(
        self,
        server: OpenAIServer,
        body: CompletionRequest | ChatCompletionRequest,
        num_prompts: int,
    ) -> None:
        self.server = server
        self.body = body
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.num_prompts = num_prompts

    def output_ids(self, choice: Choice) -> list[int]:
        """The tokens the answer gives of a choice's output (and counts in its usage)."""
        return choice.token_ids

    def usage(self, choices: list[Choice]) -> dict:
        n = max(1, len(choices) // max(self.num_prompts, 1))
        prompt = sum(len(c.prompt_token_ids) for c in choices[::n])
        completion = sum(len(self.output_ids(c)) for c in choices)
        return usage_of(prompt, completion) | self.prompt_details(choices[::n])

    def choice_usage(self, choice: Choice) -> dict:
        """One choice's usage so far (a chunk's, with continuous usage stats)."""
        usage = usage_of(len(choice.prompt_token_ids), len(self.output_ids(choice)))
        return usage | self.prompt_details([choice])

    def prompt_details(self, prompts: list[Choice]) -> dict:
        """vLLM's usage.prompt_tokens_details (--enable-prompt-tokens-details): the prompt
        tokens of `prompts` (a choice of each) that the prefix cache served."""
        if not self.server.limits.enable_prompt_tokens_details:
            return {}
        cached = sum(c.num_cached_tokens for c in prompts)
        return {"prompt_tokens_details": {"cached_tokens": cached}}

    def token_text(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or vLLM's "token_id:{id}" when asked (by
        the request, or for every request by --return-tokens-as-token-ids)."""
        if self.body.return_tokens_as_token_ids or self.server.limits.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        return self.server.token_text(token_id)

    def envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.body.model or self.server.model_name,  # or a LoRA adapter's name
            "choices": choices,
        }

    def full(self, choices: list[Choice]) -> dict:
        body = self.envelope(self.object_name, [self.full_choice(c) for c in choices])
        body["usage"] = self.usage(choices)
        return body

    async def stream(
        self, events: AsyncIterator[Event], include_usage: bool
    ) -> AsyncIterator[dict]:
        states: dict[int, Choice] = {}
        openings = self.opening()
        if openings and self.body.continuous_usage:  # their usage: the prompt's, from a delta
            first = await anext(aiter(events), None)
            for chunk in openings if first is not None else []:
                chunk["usage"] = usage_of(len(first[1].prompt_token_ids or []), 0)
            events = _after(first, events)
        for chunk in openings:
            yield chunk
        async for index, delta in events:
            choice = states.get(index)
            if choice is None:
                choice = states[index] = Choice(index)
            choice.add(delta)
            chunk = self.envelope(self.chunk_object_name, [self.delta_choice(choice, delta)])
            if self.body.continuous_usage:
                chunk["usage"] = self.choice_usage(choice)
            yield chunk | self.chunk_fields(delta)
        if include_usage:
            choices = [states[i] for i in sorted(states)]
            chunk = self.envelope(self.chunk_object_name, [])
            chunk["usage"] = self.usage(choices)
            yield chunk

    def opening(self) -> list[dict]:
        return []

    def chunk_fields(self, delta: RequestDelta) -> dict:
        """Fields of a stream chunk beside its choices."""
        return {}

    def full_choice(self, choice: Choice) -> dict:
        raise NotImplementedError

    def delta_choice(self, choice: Choice, delta: RequestDelta) -> dict:
        raise NotImplementedError


class CompletionRender(Render):
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    body: CompletionRequest

    def __init__(
        self, server: OpenAIServer, body: CompletionRequest, prompts: list[Prompt]
    ) -> None:
        super().__init__(server, body, len(prompts))
        self.prompts = prompts

    def output_ids(self, choice: Choice) -> list[int]:
        return [] if self.body.echo_only else choice.token_ids

    def echo_text(self, choice: Choice) -> str:
        if not self.body.echo:
            return ""
        prompt = self.prompts[choice.index // self.body.n]
        return prompt if isinstance(prompt, str) else self.server.text_of(prompt)

    def logprobs(self, items: list[Scored], offset: int) -> dict | None:
        """OpenAI's `logprobs` of (token id, its logprobs) items: None logprobs for the
        echoed prompt's first token, which has none."""
        if self.body.logprobs is None:
            return None
        text = self.token_text
        tokens = [text(token_id) for token_id, _ in items]
        offsets, position = [], offset
        for token in tokens:
            offsets.append(position)
            position += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else finite(e.logprob) for _, e in items],
            "top_logprobs": [None if e is None else top_with_sampled(e, text) for _, e in items],
            "text_offset": offsets,
        }

    def scored(
        self,
        prompt_ids: list[int] | None,
        prompt_logprobs: list[TokenLogprobs | None] | None,
        entries: list[TokenLogprobs],
    ) -> list[Scored]:
        """The tokens to score: the echoed prompt's (echo with prompt logprobs), then the
        output's (none for echo_only)."""
        output: list[Scored] = [] if self.body.echo_only else [(e.token_id, e) for e in entries]
        if self.body.echo and prompt_ids is not None and prompt_logprobs is not None:
            return [*zip(prompt_ids, prompt_logprobs), *output]
        return output

    def full_choice(self, choice: Choice) -> dict:
        echo = self.echo_text(choice)
        items = self.scored(choice.prompt_token_ids, choice.prompt_logprobs, choice.logprobs)
        offset = 0 if len(items) > len(choice.logprobs) else len(echo)  # scored prompt first?
        body = {
            "index": choice.index,
            "text": echo + ("" if self.body.echo_only else choice.text),
            "logprobs": self.logprobs(items, offset),
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }
        if self.body.prompt_logprobs is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(choice.prompt_logprobs, self.server)
        if self.body.return_token_ids:
            body["prompt_token_ids"] = choice.prompt_token_ids
            body["token_ids"] = self.output_ids(choice)
        return body

    def delta_choice(self, choice: Choice, delta: RequestDelta) -> dict:
        first = delta.prompt_token_ids is not None
        scoring = self.body.logprobs is not None  # its offsets count the echoed prompt
        echo = self.echo_text(choice) if first or scoring else ""
        items = self.scored(delta.prompt_token_ids, delta.prompt_logprobs, delta.logprobs or [])
        text = "" if self.body.echo_only else delta.text
        offset = len(echo) + len(choice.text) - len(delta.text)
        if len(items) > len(delta.logprobs or []):  # the scored prompt first
            offset = 0
        body = {
            "index": choice.index,
            "text": (echo if first else "") + text,
            "logprobs": self.logprobs(items, offset),
            "finish_reason": choice.finish_reason if delta.finish_reason is not None else None,
            "stop_reason": choice.stop_reason if delta.finish_reason is not None else None,
        }
        if self.body.return_token_ids:
            if first:
                body["prompt_token_ids"] = delta.prompt_token_ids
            body["token_ids"] = [] if self.body.echo_only else delta.token_ids
        return body


class ChatRender(Render):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    body: ChatCompletionRequest

    def __init__(
        self, server: OpenAIServer, body: ChatCompletionRequest, tool_parser: str | None = None
    ) -> None:
        super().__init__(server, body, 1)
        self.tools = body.tool_plan()  # a constrained reply's calls (None: none)
        self.call_ids: dict[int, str] = {}  # a named call's id, per choice (stream)
        self.tool_parser = tool_parser  # "auto": the parser that finds calls in the text
        self.parsers: dict[int, ToolCallStream] = {}  # per choice (stream)
        self.echoed = body.echoed()  # vLLM's echo: before each choice's content
        self.reasoning_parser = server.limits.reasoning_parser  # None: no reasoning split
        self.reasoning: dict[int, ReasoningStream] = {}  # per choice (stream)
        self.role = server.limits.response_role  # of each message (vLLM's --response-role)

    def logprobs(self, entries: list[TokenLogprobs]) -> dict | None:
        if not self.body.logprobs:
            return None
        return {"content": [self.token_logprob(e) for e in entries]}

    def token_logprob(self, entry: TokenLogprobs) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            token = self.token_text(token_id)
            return {"token": token, "logprob": finite(logprob), "bytes": list(token.encode())}

        top = [item(t, lp) for t, lp in zip(entry.top_token_ids, entry.top_logprobs)]
        return {**item(entry.token_id, entry.logprob), "top_logprobs": top}

    def full(self, choices: list[Choice]) -> dict:
        body = super().full(choices)
        if self.body.prompt_logprobs is not None and choices:  # vLLM's, for the one prompt
            body["prompt_logprobs"] = vllm_prompt_logprobs(choices[0].prompt_logprobs, self.server)
        if self.body.return_token_ids and choices:
            body["prompt_token_ids"] = choices[0].prompt_token_ids
        return body

    def chunk_fields(self, delta: RequestDelta) -> dict:
        if self.body.return_token_ids and delta.prompt_token_ids is not None:
            return {"prompt_token_ids": delta.prompt_token_ids}
        return {}

    def opening(self) -> list[dict]:
        deltas = [{"role": self.role, "content": ""}]
        if self.echoed:
            deltas.append({"content": self.echoed})
        return [
            self.envelope(
                self.chunk_object_name,
                [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}],
            )
            for delta in deltas
            for i in range(self.body.n)
        ]

    def full_choice(self, choice: Choice) -> dict:
        text, reasoning = choice.text, None
        if self.reasoning_parser is not None:
            reasoning, text = split_reasoning(text, self.reasoning_parser)
            text = text or ""
        message: dict = {"role": self.role, "content": self.echoed + text}
        finish_reason = choice.finish_reason
        calls = None if self.tools is None else self.tools.calls(text)
        if calls is not None:
            assert self.tools is not None
            message = {"role": self.role, "content": None, "tool_calls": calls}
            finish_reason = self.tools.finish_reason or finish_reason
        elif self.tool_parser is not None:
            content, found = parse_tool_calls(self.tool_text(choice.text, text), self.tool_parser)
            if found:
                unindexed = [{k: v for k, v in c.items() if k != "index"} for c in found]
                message = {"role": self.role, "content": content, "tool_calls": unindexed}
                finish_reason = "tool_calls"
            elif reads_harmony(self.tool_parser):  # harmony's content, not the reply as written
                message["content"] = self.echoed + (content or "")
        if self.reasoning_parser is not None:
            message["reasoning_content"] = reasoning
        body = {
            "index": choice.index,
            "message": message,
            "logprobs": self.logprobs(choice.logprobs),
            "finish_reason": finish_reason,
            "stop_reason": choice.stop_reason,
        }
        if self.body.return_token_ids:
            body["token_ids"] = choice.token_ids
        return body

    def delta_choice(self, choice: Choice, delta: RequestDelta) -> dict:
        done = delta.finish_reason is not None
        reasoning = ""
        if self.reasoning_parser is not None:
            stream = self.reasoning.setdefault(choice.index, stream_for(self.reasoning_parser))
            reasoning, text = stream.feed(delta.text, final=done)
            delta = msgspec.structs.replace(delta, text=self.tool_text(delta.text, text))
        content, finish_reason = self.streamed_content(choice, delta)
        if reasoning:
            content = {"reasoning_content": reasoning} | {k: v for k, v in content.items() if v}
        body = {
            "index": choice.index,
            "delta": content,
            "logprobs": self.logprobs(delta.logprobs or []),
            "finish_reason": finish_reason if done else None,
            "stop_reason": choice.stop_reason if done else None,
        }
        if self.body.return_token_ids:
            body["token_ids"] = delta.token_ids
        return body

    def tool_text(self, written: str, content: str) -> str:
        """The text the reply's content and calls are read from: the reasoning parser's
        content, or the reply as written for a tool parser that reads harmony (it finds the
        content itself)."""
        return written if reads_harmony(self.tool_parser) else content

    def streamed_content(self, choice: Choice, delta: RequestDelta) -> tuple[dict, str | None]:
        """A chunk's delta and the choice's finish: content; a named call's arguments as they
        come (its id and name first); "required" calls once the reply is whole."""
        if self.tool_parser is not None:
            return self.parsed_content(choice, delta, self.tool_parser)
        if self.tools is None:
            return {"content": delta.text}, choice.finish_reason
        if self.tools.named is not None:
            call: dict = {"index": 0, "function": {"arguments": delta.text}}
            if choice.index not in self.call_ids:
                self.call_ids[choice.index] = new_call_id()
                call |= {"id": self.call_ids[choice.index], "type": "function"}
                call["function"] = {"name": self.tools.named, **call["function"]}
            return {"tool_calls": [call]}, choice.finish_reason
        if delta.finish_reason is None:
            return {}, None
        calls = self.tools.calls(choice.text)
        if calls is None:  # cut short: what it wrote, as content
            return {"content": choice.text}, choice.finish_reason
        return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}, "tool_calls"

    def parsed_content(
        self, choice: Choice, delta: RequestDelta, parser: str
    ) -> tuple[dict, str | None]:
        """With "auto" tool choice: the content the parser gives out, each call once whole."""
        stream = self.parsers.get(choice.index)
        if stream is None:
            stream = self.parsers[choice.index] = PARSERS[parser]()
        content, calls = stream.feed(delta.text, final=delta.finish_reason is not None)
        out: dict = {"content": content} if content or not calls else {}
        if calls:
            out["tool_calls"] = calls
        return out, "tool_calls" if stream.calls else choice.finish_reason


class PooledRender:
    """An answer made of pooled vectors, given whole: the base of the embeddings, score,
    rerank and classify answers."""

    id_prefix = ""

    def __init__(self, server: OpenAIServer, model: str | None) -> None:
        self.server = server
        self.model = model or server.model_name  # or a LoRA adapter's name
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def full(self, choices: list[Choice]) -> dict:
        raise NotImplementedError

    def listing(self, data: list[dict], choices: list[Choice]) -> dict:
        """The OpenAI "list" answer of `data`, the choices' prompt tokens as its usage."""
        tokens = prompt_tokens(choices)
        return {
            "id": self.id,
            "object": "list",
            "created": self.created,
            "model": self.model,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


def prompt_tokens(choices: list[Choice]) -> int:
    return sum(len(choice.prompt_token_ids) for choice in choices)


class EmbeddingRender(PooledRender):
    """The /v1/embeddings answer: each input's vector, as floats or (encoding_format base64,
    which OpenAI's client asks for by default) its little-endian float32 bytes in base64, and
    the inputs' tokens as its usage."""

    id_prefix = "embd"

    def __init__(self, server: OpenAIServer, body: EmbeddingRequest) -> None:
        super().__init__(server, body.model)
        self.body = body

    def full(self, choices: list[Choice]) -> dict:
        return self.listing([self.item(choice) for choice in choices], choices)

    def item(self, choice: Choice) -> dict:
        vector = choice.embedding or b""
        encoded: str | list[float] = (
            base64.b64encode(vector).decode()
            if self.body.encoding_format == "base64"
            else embedding_floats(vector)
        )
        return {"object": "embedding", "embedding": encoded, "index": choice.index}


class ClassificationRender(PooledRender):
    """vLLM's /classify answer: each input's labels' probabilities (from the logits the engine
    gives: api/classification.py), the likeliest label's name and the number of labels; the
    inputs' tokens as usage."""

    id_prefix = "classify"

    def __init__(
        self, server: OpenAIServer, body: ClassificationRequest, classifier: Classifier
    ) -> None:
        super().__init__(server, body.model)
        self.classifier = classifier

    def full(self, choices: list[Choice]) -> dict:
        return self.listing([self.item(choice) for choice in choices], choices)

    def item(self, choice: Choice) -> dict:
        probs = self.classifier.probabilities(choice.embedding or b"")
        return {
            "index": choice.index,
            "label": self.classifier.label(probs),
            "probs": probs,
            "num_classes": len(probs),
        }


class ScoreRender(PooledRender):
    """vLLM's /score answer: each pair's score (api/scoring.py), in text_2's order; the tokens
    pooled (an embedding model's distinct texts, each once; a cross-encoder's pairs) as
    usage."""

    id_prefix = "score"

    def __init__(self, server: OpenAIServer, body: ScoreRequest, plan: ScorePlan) -> None:
        super().__init__(server, body.model)
        self.plan = plan

    def full(self, choices: list[Choice]) -> dict:
        scores = self.plan.scores([choice.embedding or b"" for choice in choices])
        data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]
        return self.listing(data, choices)


class RerankRender(PooledRender):
    """vLLM's /rerank answer: the documents by relevance (their score against the query),
    best first, the best top_n of them (0: all)."""

    id_prefix = "rerank"

    def __init__(self, server: OpenAIServer, body: RerankRequest, plan: ScorePlan) -> None:
        super().__init__(server, body.model)
        self.documents, self.top_n, self.plan = body.documents, body.top_n, plan

    def full(self, choices: list[Choice]) -> dict:
        scores = self.plan.scores([choice.embedding or b"" for choice in choices])
        ranked = sorted(range(len(scores)), key=lambda index: -scores[index])
        results = [
            {
                "index": index,
                "document": {"text": self.documents[index]},
                "relevance_score": scores[index],
            }
            for index in ranked[: self.top_n or None]
        ]
        usage = {"total_tokens": prompt_tokens(choices)}
        return {"id": self.id, "model": self.model, "usage": usage, "results": results}


def top_with_sampled(entry: TokenLogprobs, text: Callable[[int], str]) -> dict[str, float]:
    """A completions `top_logprobs` entry: the top k, plus the sampled token when it is not
    among them (as OpenAI and vLLM answer)."""
    top = {text(t): finite(lp) for t, lp in zip(entry.top_token_ids, entry.top_logprobs)}
    top.setdefault(text(entry.token_id), finite(entry.logprob))
    return top


def finite(logprob: float) -> float:
    """A logprob JSON can carry (-inf: MIN_LOGPROB)."""
    return max(logprob, MIN_LOGPROB)


def vllm_prompt_logprobs(
    entries: list[TokenLogprobs | None] | None, server: OpenAIServer
) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), {token id: {logprob,
    rank, decoded_token}} for the token and its top alternatives."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(token_id): {
                "logprob": finite(lp.logprob),
                "rank": lp.rank,
                "decoded_token": server.token_text(token_id),
            }
            for token_id, lp in logprob_dict(entry).items()
        }
        for entry in entries
    ]
