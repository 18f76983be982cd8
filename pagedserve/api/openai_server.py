"""OpenAI-compatible HTTP server: a Starlette app on uvicorn, running as its own actor process.

Endpoints: POST /v1/completions, POST /v1/chat/completions (streaming as server-sent events
ending in `data: [DONE]`, or not), GET /v1/models, GET /health, GET /metrics. It reaches the
engine only through the async ZeroMQ client, like any other client.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pagedserve.actors.actor import Actor
from pagedserve.actors.chat import load_tokenizer
from pagedserve.actors.messages import ChatMessage, RequestDelta, SamplingParams
from pagedserve.api.actor_status import AsyncStatusClient, render_prometheus
from pagedserve.api.client import AsyncClient
from pagedserve.api.client_core import EngineRequestError, Prompt
from pagedserve.api.generation import Choice, stream_choices
from pagedserve.api.metrics import Metrics, RequestTimer
from pagedserve.api.protocol import ChatCompletionRequest, CompletionRequest, decode_body
from pagedserve.api.render import ChatRender, CompletionRender, Render


def error_response(message: str, status: int, kind: str = "invalid_request_error") -> JSONResponse:
    code = {404: "model_not_found", 401: "invalid_api_key"}.get(status)
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status)


class OpenAIServer:
    """Route handlers; state is the client, the tokenizer (for logprob token strings) and
    the metrics."""

    def __init__(
        self,
        client: AsyncClient,
        model_name: str,
        tokenizer: Any,
        api_key: str | None,
        max_model_len: int,
    ) -> None:
        self.client = client
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.api_key = api_key
        self.max_model_len = max_model_len
        self.metrics = Metrics()
        self.created = int(time.time())
        self.actor_status: AsyncStatusClient | None = None  # the supervisor's view of actors

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ]

    # ------------------------------------------------------------------ simple endpoints

    async def health(self, request: Request) -> Response:
        return Response(status_code=503 if self.client.core.failure else 200)

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "pagedserve",
            "max_model_len": self.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def prometheus(self, request: Request) -> Response:
        try:
            stats = await self.client.stats(timeout_s=5.0)
        except TimeoutError:
            stats = None
        body = self.metrics.render(stats)
        status = await self.actor_status.fetch() if self.actor_status is not None else None
        if status is not None:
            body += render_prometheus(status)
        return Response(body, media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------------ generation

    def check(self, request: Request, model: str | None) -> Response | None:
        if self.api_key is not None:
            if request.headers.get("authorization") != f"Bearer {self.api_key}":
                return error_response("invalid API key", 401, "authentication_error")
        if model is not None and model != self.model_name:
            return error_response(f"The model `{model}` does not exist.", 404, "NotFoundError")
        return None

    async def completions(self, request: Request) -> Response:
        try:
            body: CompletionRequest = decode_body(await request.body(), CompletionRequest)  # type: ignore[assignment]
            rejected = self.check(request, body.model)
            if rejected is not None:
                return rejected
            sampling, prompts = body.to_sampling(), body.prompts()
        except ValueError as exc:
            return error_response(str(exc), 400)
        render = CompletionRender(self, body, prompts)
        return await self.respond(render, prompts, sampling, body.stream, body.include_usage)

    async def chat_completions(self, request: Request) -> Response:
        try:
            body: ChatCompletionRequest = decode_body(await request.body(), ChatCompletionRequest)  # type: ignore[assignment]
            rejected = self.check(request, body.model)
            if rejected is not None:
                return rejected
            sampling = body.to_sampling()
        except ValueError as exc:
            return error_response(str(exc), 400)
        messages = [ChatMessage(m.role, m.text()) for m in body.messages]
        render = ChatRender(self, body)
        return await self.respond(render, [messages], sampling, body.stream, body.include_usage)

    async def respond(
        self,
        render: Render,
        prompts: list[Prompt],
        sampling: SamplingParams,
        stream: bool,
        include_usage: bool,
    ) -> Response:
        events = self.run(prompts, sampling)
        if stream:
            first = await anext_or_error(events)
            if isinstance(first, Response):
                return first
            return StreamingResponse(
                sse(render.stream(first, events, include_usage)), media_type="text/event-stream"
            )
        choices = [Choice(i) for i in range(len(prompts) * sampling.n)]
        try:
            async for index, delta in events:
                choices[index].add(delta)
        except EngineRequestError as exc:
            return error_response(str(exc), exc.status_code)
        return JSONResponse(render.full(choices))

    async def run(
        self, prompts: list[Prompt], sampling: SamplingParams
    ) -> AsyncIterator[tuple[int, RequestDelta]]:
        timers: dict[int, RequestTimer] = {}
        async for index, delta in stream_choices(self.client, prompts, sampling):
            timer = timers.setdefault(index, RequestTimer(self.metrics))
            timer.on_tokens(len(delta.token_ids))
            if delta.prompt_token_ids is not None:
                timer.num_prompt_tokens = len(delta.prompt_token_ids)
            if delta.finish_reason is not None:
                timer.on_finish(delta.finish_reason.openai_name)
            yield index, delta

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


async def anext_or_error(
    events: AsyncIterator[tuple[int, RequestDelta]],
) -> tuple[int, RequestDelta] | Response:
    """The first event, or the error response if the engine rejected the request."""
    try:
        return await events.__anext__()
    except EngineRequestError as exc:
        return error_response(str(exc), exc.status_code)


async def sse(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        yield b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


def build_app(server: OpenAIServer) -> Starlette:
    return Starlette(routes=server.routes())


class APIServerActor(Actor):
    """Runs uvicorn inside the actor's anyio loop on the listening socket the supervisor bound
    once (`listen_fd`): connections made while this actor restarts wait in its backlog."""

    name = "api-server"

    def prepare(self) -> None:
        self.tokenizer = load_tokenizer(self.config.tokenizer_path)

    async def setup(self) -> dict:
        server_config = self.config.server
        assert server_config is not None, "serve needs a ServerConfig"
        if self.listen_fd >= 0:
            self.listener = socket.socket(fileno=self.listen_fd)
        else:
            self.listener = socket.create_server((server_config.host, server_config.port))
        self.server_config = server_config
        self.engine_client: AsyncClient | None = None
        return {}

    def queue_depths(self) -> dict[str, int]:
        client = self.engine_client
        return {"requests": len(client.core.requests)} if client is not None else {}

    async def run(self) -> None:
        credentials = self.credentials.for_clients() if self.credentials else None
        async with AsyncClient(self.addresses.engine_address, credentials=credentials) as client:
            self.engine_client = client
            handler = OpenAIServer(
                client,
                self.server_config.served_model_name or self.config.model,
                self.tokenizer,
                self.server_config.api_key,
                self.config.max_model_len or 0,
            )
            handler.actor_status = AsyncStatusClient(self.addresses.engine_address, credentials)
            config = uvicorn.Config(
                build_app(handler), log_level="warning", lifespan="off", timeout_graceful_shutdown=1
            )
            try:
                await uvicorn.Server(config).serve(sockets=[self.listener])
            finally:
                handler.actor_status.close()
