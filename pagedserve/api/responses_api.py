"""OpenAI's Responses API, `POST /v1/responses`, stateless, for plain chat models (as vLLM
serves it): a request is mapped onto a chat completion (`instructions` the first, system,
message; `input` a text or message items of text parts), which runs through the chat endpoint's
checks, limits, template, sampling defaults and LoRA adapters, and is answered as one "message"
output item, whole or as the Responses stream events (`event: <type>` server-sent events with
increasing `sequence_number`s, ending in exactly one response.completed, whose response's status
may be "incomplete" (as vLLM's, and what the openai client's stream helper waits for), or
response.failed; no `data: [DONE]`).

Stateless: nothing is stored, so `store` is accepted and ignored (no response can be fetched
later), and `previous_response_id` is a 400. `tools` (beyond an empty list, tool_choice "none")
and input items other than messages of text are a 400; `text.format` text, json_object and
json_schema map onto the chat endpoint's response_format. With a reasoning parser (`serve
--reasoning-parser`) the reply's thinking is a "reasoning" output item before the message (its
text a reasoning_text part; streamed as response.reasoning_text.delta events), and
usage.output_tokens_details.reasoning_tokens counts the output tokens of the deltas that carried
it or its tags; the request's `reasoning` settings are echoed, and their `effort` reaches the
chat template as the chat endpoint's `reasoning_effort` does. Unknown
fields are ignored, as on every endpoint.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.types import Send

from pagedserve.actors.messages import RequestDelta, SamplingParams
from pagedserve.api.body import read_json
from pagedserve.api.client import EngineRequestError
from pagedserve.api.errors import APIError
from pagedserve.api.generation import Choice, Event, plan_jobs
from pagedserve.api.protocol import (
    REASONING_EFFORTS,
    ChatCompletionRequest,
    ChatMessageIn,
    Int64,
)
from pagedserve.api.reasoning_parsers import keeps_special_tokens, split_reasoning, stream_for
from pagedserve.api.render import Render
from pagedserve.api.responses import SSE_HEADERS, GenerationResponse
from pagedserve.api.structured import JsonSchemaFormat, ResponseFormat

if TYPE_CHECKING:
    from pagedserve.api.openai_server import OpenAIServer

logger = logging.getLogger(__name__)

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")


class InputPart(msgspec.Struct, kw_only=True):
    type: str
    text: str = ""


class InputMessage(msgspec.Struct, kw_only=True):
    """An input item: a message (the only kind of item supported)."""

    role: str
    content: str | list[InputPart]
    type: str = "message"

    def to_chat(self) -> ChatMessageIn:
        if self.type != "message":
            raise ValueError(f"input items of type {self.type!r} are not supported")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        return ChatMessageIn(role=ROLES[self.role], content=self.text())

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type not in TEXT_PARTS:
                raise ValueError(f"content parts of type {part.type!r} are not supported")
        return "".join(part.text for part in self.content)


class TextFormat(msgspec.Struct, kw_only=True):
    type: str = "text"
    name: str | None = None
    schema: Any = None
    description: str | None = None
    strict: bool | None = None

    def response_format(self) -> ResponseFormat | None:
        """The chat endpoint's response_format of this format (None: plain text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return ResponseFormat(type="json_object")
        if self.type != "json_schema":
            raise ValueError(f"text.format {self.type!r} is not supported")
        schema = JsonSchemaFormat(
            name=self.name, description=self.description, schema=self.schema, strict=self.strict
        )
        return ResponseFormat(type="json_schema", json_schema=schema)


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """The subset of OpenAI's ResponseCreateParams a stateless server can follow."""

    input: str | list[InputMessage]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None  # echoed
    store: bool = True  # accepted; nothing is stored
    reasoning: dict[str, Any] | None = None  # echoed; its effort is the chat's reasoning_effort
    text: TextConfig | None = None
    parallel_tool_calls: bool = True
    # Not implemented: a 400 when asked for
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None

    def check_supported(self) -> None:
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id is not supported: this server is stateless")
        if self.tools or self.tool_choice not in (None, "none"):
            raise ValueError("tools are not supported on /v1/responses")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be at least 1, got {self.max_output_tokens}")
        if self.effort() not in (None, *REASONING_EFFORTS):
            raise ValueError(f"reasoning.effort must be one of {REASONING_EFFORTS}")

    def effort(self) -> Any:
        return (self.reasoning or {}).get("effort")

    def chat_messages(self) -> list[ChatMessageIn]:
        items = (
            [InputMessage(role="user", content=self.input)]
            if isinstance(self.input, str)
            else self.input
        )
        messages = [item.to_chat() for item in items]
        if self.instructions is not None:
            messages.insert(0, ChatMessageIn(role="system", content=self.instructions))
        return messages

    def to_chat(self) -> ChatCompletionRequest:
        """The chat completion this request asks for."""
        text_format = self.text.format if self.text is not None else None
        return ChatCompletionRequest(
            messages=self.chat_messages(),
            model=self.model,
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stream=self.stream,
            user=self.user,
            response_format=text_format.response_format() if text_format else None,
            reasoning_effort=self.effort(),
        )


async def create_response(server: OpenAIServer, request: Request) -> GenerationResponse:
    """The `POST /v1/responses` handler."""
    arrival = time.perf_counter()
    body = await read_json(request, ResponsesRequest, server.limits)
    lora = server.check_model(body.model)
    try:
        body.check_supported()
        chat = body.to_chat()
        chat.check_supported()
        chat.check_limits(server.limits)
        messages = chat.chat_messages(server.limits)
        sampling = chat.to_sampling(server.defaults)
    except ValueError as exc:
        raise APIError(str(exc), 400) from None
    if keeps_special_tokens(server.limits.reasoning_parser):  # its reply's markers
        sampling = msgspec.structs.replace(sampling, skip_special_tokens=False)
    render = ResponsesRender(server, body, chat, sampling)
    if not server.limits.disable_log_requests:
        logger.info("%s: %d message(s), %s", render.id, len(messages), sampling)
    jobs = plan_jobs([messages], sampling, chat.prompt_options(), chat.priority, lora)
    return ResponsesGeneration(
        server.client, server.metrics, render, jobs, body.stream, False, arrival
    )


class ReplySplit:
    """The one reply's reasoning and content by the server's reasoning parser (None: all
    content), fed delta by delta, and the output tokens of the deltas that carried reasoning
    or its tags or markers (exact when a delta is one token, as in a plain decode step)."""

    def __init__(self, parser: str | None) -> None:
        self.stream = None if parser is None else stream_for(parser)
        self.reasoning = self.content = ""
        self.reasoning_tokens = 0

    def feed(self, delta: RequestDelta) -> tuple[str, str]:
        """This delta's (reasoning, content) text."""
        if self.stream is None:
            self.content += delta.text
            return "", delta.text
        before = self.stream.state
        reasoning, content = self.stream.feed(delta.text, final=delta.finish_reason is not None)
        if reasoning or "reasoning" in (before, self.stream.state):
            self.reasoning_tokens += len(delta.token_ids)
        self.reasoning += reasoning
        self.content += content
        return reasoning, content


class ResponsesRender(Render):
    """The Response object of the one choice, and its stream events (without their
    sequence numbers)."""

    def __init__(
        self,
        server: OpenAIServer,
        request: ResponsesRequest,
        chat: ChatCompletionRequest,
        sampling: SamplingParams,
    ) -> None:
        super().__init__(server, chat, 1)
        self.id = f"resp_{uuid.uuid4().hex}"
        self.request = request
        self.sampling = sampling
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.parser = server.limits.reasoning_parser
        self.split = ReplySplit(self.parser)  # fed the deltas, whole or streamed

    def full(self, choices: list[Choice]) -> dict:
        return self.response(choices[0])

    def parts(self, choice: Choice) -> tuple[str | None, str]:
        """(reasoning or None, content) of the finished reply: as streamed, or as the chat
        endpoint splits a whole reply."""
        if self.request.stream:
            return self.split.reasoning or None, self.split.content
        if self.parser is None:
            return None, choice.text
        reasoning, content = split_reasoning(choice.text, self.parser)
        return reasoning, content or ""

    def response(self, choice: Choice | None, failure: str | None = None) -> dict:
        """The Response object: in progress (no choice yet), failed, or finished."""
        status, reason = "in_progress", None
        if failure is not None:
            status = "failed"
        elif choice is not None:
            cut = choice.finish_reason == "length"
            status, reason = ("incomplete", "max_output_tokens") if cut else ("completed", None)
        text_format = self.request.text.format if self.request.text else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None if failure is None else {"code": "server_error", "message": failure},
            "incomplete_details": None if reason is None else {"reason": reason},
            "instructions": self.request.instructions,
            "metadata": self.request.metadata,
            "model": self.request.model or self.server.model_name,
            "output": [] if choice is None else self.output(choice, status),
            "parallel_tool_calls": self.request.parallel_tool_calls,
            "temperature": self.sampling.temperature,
            "tool_choice": "none",
            "tools": [],
            "top_p": self.sampling.top_p,
            "max_output_tokens": self.request.max_output_tokens,
            "previous_response_id": None,
            "reasoning": self.request.reasoning,
            "text": {"format": msgspec.to_builtins(text_format or {"type": "text"})},
            "truncation": "disabled",
            "user": self.request.user,
            "usage": None if choice is None else self.response_usage(choice),
        }

    def output(self, choice: Choice, status: str) -> list[dict]:
        """The output items: the reasoning (if the reply has any), then the message."""
        reasoning, content = self.parts(choice)
        items = [] if reasoning is None else [self.reasoning_item(reasoning, status)]
        return [*items, self.message(content, status)]

    def message(self, text: str | None, status: str) -> dict:
        """The output message item (status: in_progress, completed or incomplete; text None
        while in progress)."""
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [] if text is None else [output_text(text)],
        }

    def reasoning_item(self, text: str | None, status: str) -> dict:
        """The reasoning output item (text None while in progress)."""
        content = [] if text is None else [{"type": "reasoning_text", "text": text}]
        return {
            "type": "reasoning",
            "id": self.reasoning_id,
            "summary": [],
            "content": content,
            "status": status,
        }

    def response_usage(self, choice: Choice) -> dict:
        prompt, output = len(choice.prompt_token_ids), len(choice.token_ids)
        reasoning = self.split.reasoning_tokens if self.parts(choice)[0] is not None else 0
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": choice.num_cached_tokens},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + output,
        }

    async def stream(
        self, events: AsyncIterator[Event], include_usage: bool
    ) -> AsyncIterator[dict]:
        """The stream events, the last one the finished response (its status completed or
        incomplete)."""
        choice = Choice(0)
        yield {"type": "response.created", "response": self.response(None)}
        yield {"type": "response.in_progress", "response": self.response(None)}
        opened: list[str] = []  # the output items begun, in order: "reasoning", "message"
        async for _, delta in events:
            choice.add(delta)
            reasoning, content = self.split.feed(delta)
            if reasoning:
                if not opened:
                    opened.append("reasoning")
                    yield self.item_event("added", self.reasoning_item(None, "in_progress"), 0)
                yield self.at_reasoning({"type": "response.reasoning_text.delta",
                                         "delta": reasoning})  # fmt: skip
            if content:
                for event in self.open_message(opened):
                    yield event
                yield self.at_content({"type": "response.output_text.delta", "delta": content})
        for event in self.open_message(opened):
            yield event
        final = self.response(choice)
        text = self.split.content
        yield self.at_content({"type": "response.output_text.done", "text": text})
        yield self.part_event("done", output_text(text))
        yield self.item_event("done", final["output"][-1], len(opened) - 1)
        yield {"type": "response.completed", "response": final}

    def open_message(self, opened: list[str]) -> list[dict]:
        """The events that close the reasoning item (if open) and begin the message item, the
        first time content comes (or the reply ends); none after that."""
        if "message" in opened:
            return []
        events = []
        if opened:  # the reasoning, whole
            text = self.split.reasoning
            events.append(self.at_reasoning({"type": "response.reasoning_text.done",
                                             "text": text}))  # fmt: skip
            events.append(self.item_event("done", self.reasoning_item(text, "completed"), 0))
        opened.append("message")
        events.append(self.item_event("added", self.message(None, "in_progress"), len(opened) - 1))
        events.append(self.part_event("added", output_text("")))
        return events

    def item_event(self, kind: str, item: dict, index: int) -> dict:
        return {"type": f"response.output_item.{kind}", "output_index": index, "item": item}

    def part_event(self, kind: str, part: dict) -> dict:
        return self.at_content({"type": f"response.content_part.{kind}", "part": part})

    def at_content(self, event: dict) -> dict:
        """An event about the message's one text part (after the reasoning item, if any)."""
        index = 1 if self.split.reasoning else 0
        where = {"item_id": self.message_id, "output_index": index, "content_index": 0}
        if event["type"].startswith("response.output_text."):
            where["logprobs"] = []
        return event | where

    def at_reasoning(self, event: dict) -> dict:
        """An event about the reasoning item's one text part (always the first item)."""
        return event | {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


class ResponsesGeneration(GenerationResponse):
    """Streams the Responses events: once the engine has taken the request (a request it
    rejects is still an HTTP error), each as `event: <type>` with its sequence number; an
    engine error after that ends the stream with response.failed."""

    render: ResponsesRender

    async def send_whole(self, events: AsyncIterator[Event], send: Send) -> None:
        await super().send_whole(self.split(events), send)

    async def split(self, events: AsyncIterator[Event]) -> AsyncIterator[Event]:
        """The events, each fed to the render's reasoning split on the way (its token
        count)."""
        async for event in events:
            self.render.split.feed(event[1])
            yield event

    async def send_stream(self, events: AsyncIterator[Event], send: Send) -> None:
        first = await anext(events, None)
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        number = 0
        try:
            async for event in self.render.stream(_after(first, events), False):
                await _send_event(send, event | {"sequence_number": number})
                number += 1
        except EngineRequestError as exc:
            failed = self.render.response(None, failure=str(exc))
            event = {"type": "response.failed", "response": failed, "sequence_number": number}
            await _send_event(send, event)
        await send({"type": "http.response.body", "body": b""})


async def _after(first: Event | None, rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    if first is not None:
        yield first
    async for event in rest:
        yield event


async def _send_event(send: Send, event: dict) -> None:
    data = b"event: %s\ndata: %s\n\n" % (event["type"].encode(), msgspec.json.encode(event))
    await send({"type": "http.response.body", "body": data, "more_body": True})
