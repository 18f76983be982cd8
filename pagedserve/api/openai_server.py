"""OpenAI-compatible HTTP server: a Starlette app on uvicorn, running as its own actor process.

Endpoints: POST /v1/completions, POST /v1/chat/completions (streaming as server-sent events
ending in `data: [DONE]`, or not), POST /v1/embeddings, POST /classify and /v1/classify (vLLM's:
a sequence classifier's probabilities), POST /score and /v1/score, POST /rerank,
/v1/rerank and /v2/rerank (vLLM's: cosine similarities of embeddings, or a cross-encoder's
scores), GET /v1/models and /v1/models/{id}, POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, POST /tokenize and /detokenize (vLLM's shapes), GET /health and GET
or POST /ping (200 only while the engine answers), /metrics and /version. It reaches the
engine only through the async ZeroMQ client, like any other client. Every request is checked
against `ServerConfig`'s limits before anything is decoded or queued.
"""

from __future__ import annotations

import functools
import logging
import socket
import time
from typing import Any

import anyio
import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

import pagedserve
from pagedserve.actors.actor import Actor
from pagedserve.actors.chat import (
    apply_chat_template,
    check_prompt_options,
    eos_token_ids,
    load_tokenizer,
)
from pagedserve.actors.heap_trim import trim_heap_forever
from pagedserve.actors.messages import (
    ChatMessage,
    LoRARequest,
    PromptOptions,
    SamplingParams,
)
from pagedserve.api.actor_status import AsyncStatusClient, render_prometheus
from pagedserve.api.auth import APIKeyGuard
from pagedserve.api.beam_search import BeamEngineFacts, BeamSearchParams, open_beams
from pagedserve.api.body import read_json
from pagedserve.api.classification import Classifier
from pagedserve.api.client import AsyncClient
from pagedserve.api.client_core import Prompt
from pagedserve.api.errors import APIError, on_api_error, on_http_exception
from pagedserve.api.generation import Job, open_choices, plan_jobs
from pagedserve.api.lora_adapters import (
    LoadLoRAAdapterRequest,
    LoRAAdapters,
    UnloadLoRAAdapterRequest,
)
from pagedserve.api.metrics import Metrics
from pagedserve.api.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
    check_token_prompt,
)
from pagedserve.api.reasoning_parsers import keeps_special_tokens
from pagedserve.api.render import (
    ChatRender,
    ClassificationRender,
    CompletionRender,
    EmbeddingRender,
    PooledRender,
    Render,
    RerankRender,
    ScoreRender,
)
from pagedserve.api.responses import GenerationResponse
from pagedserve.api.responses_api import create_response
from pagedserve.api.sampling_defaults import sampling_defaults
from pagedserve.config import EngineConfig, ServerConfig, read_hf_config

logger = logging.getLogger(__name__)


class OpenAIServer:
    """Route handlers. State: the engine client, the tokenizer (token strings, /tokenize; None
    with skip_tokenizer_init), the sampling defaults of the generation config, the metrics, the
    served LoRA adapters (kept in `state_dir` across restarts of the API server)."""

    def __init__(
        self,
        client: AsyncClient,
        config: EngineConfig,
        tokenizer: Any,
        defaults: dict[str, Any],
        state_dir: str | None = None,
    ) -> None:
        assert config.server is not None and config.max_model_len is not None
        self.client = client
        self.limits: ServerConfig = config.server
        self.model_name = self.limits.served_model_name or config.model
        self.max_model_len = config.max_model_len
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids(config.model_path, tokenizer)  # beam search's
        self.loras = LoRAAdapters(config, self.model_name, state_dir)  # by a request's `model`
        self.model_config = read_hf_config(config.model_path, config.hf_overrides)
        self.vocab_size = (
            len(tokenizer) if tokenizer is not None else self.model_config["vocab_size"]
        )
        self.classifier = Classifier.of(self.model_config)  # /classify's labels and activation
        self.defaults = defaults
        self.metrics = Metrics()
        self.created = int(time.time())
        self.tokenizer_lock = anyio.Lock()  # one tokenizer call at a time, off the event loop
        self.actor_status: AsyncStatusClient | None = None  # the supervisor's view of actors

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/responses", functools.partial(create_response, self), methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            *(
                Route(path, self.classify, methods=["POST"])
                for path in ("/classify", "/v1/classify")
            ),
            *(Route(path, self.score, methods=["POST"]) for path in ("/score", "/v1/score")),
            *(
                Route(path, self.rerank, methods=["POST"])
                for path in ("/rerank", "/v1/rerank", "/v2/rerank")
            ),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ping", self.health, methods=["GET", "POST"]),  # vLLM's (SageMaker's) name
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
        ]

    # ------------------------------------------------------------------ engine and models

    async def engine_ready(self) -> bool:
        """Whether the engine answers a round trip within the health check's deadline."""
        timeout = self.limits.health_check_timeout_s
        with anyio.move_on_after(timeout):
            try:
                await self.client.stats(timeout_s=timeout)
                return True
            except TimeoutError:
                return False
        return False

    async def health(self, request: Request) -> Response:
        ready = not self.client.core.failure and await self.engine_ready()
        return Response(status_code=200 if ready else 503)

    async def models(self, request: Request) -> Response:
        await self.require_engine()
        cards = [self.model_card(), *(self.model_card(lora) for lora in self.loras.served())]
        return JSONResponse({"object": "list", "data": cards})

    async def model(self, request: Request) -> Response:
        lora = self.check_model(request.path_params["model_id"])
        await self.require_engine()
        return JSONResponse(self.model_card(lora))

    async def require_engine(self) -> None:
        if not await self.engine_ready():
            raise APIError("the engine is not ready to serve requests", 503)

    def model_card(self, lora: LoRARequest | None = None) -> dict:
        """The served model's card, or a LoRA adapter's (its parent the model, as vLLM's)."""
        return {
            "id": self.model_name if lora is None else lora.lora_name,
            "object": "model",
            "created": self.created,
            "owned_by": "pagedserve",
            "root": self.model_name if lora is None else lora.lora_path,
            "parent": None if lora is None else self.model_name,
            "max_model_len": self.max_model_len,
        }

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the model itself), else a 404."""
        if model is None or model == self.model_name:
            return None
        lora = self.loras.get(model)
        if lora is None:
            raise APIError(f"The model `{model}` does not exist.", 404, "model_not_found")
        return lora

    async def load_lora_adapter(self, request: Request) -> Response:
        self.loras.require_runtime_updating()
        body = await read_json(request, LoadLoRAAdapterRequest, self.limits)
        await self.loras.load(body)
        logger.info("LoRA adapter %r loaded from %s", body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        self.loras.require_runtime_updating()
        body = await read_json(request, UnloadLoRAAdapterRequest, self.limits)
        lora = await self.loras.unload(body)
        logger.info("LoRA adapter %r unloaded", lora.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' removed successfully.")

    async def prometheus(self, request: Request) -> Response:
        try:
            stats = await self.client.stats(timeout_s=self.limits.health_check_timeout_s)
        except TimeoutError:
            stats = None
        body = self.metrics.render(stats)
        status = await self.actor_status.fetch() if self.actor_status is not None else None
        if status is not None:
            body += render_prometheus(status)
        return Response(body, media_type="text/plain; version=0.0.4")

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": pagedserve.__version__})

    # ------------------------------------------------------------------ generation

    async def completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        body = await read_json(request, CompletionRequest, self.limits)
        lora = self.check_model(body.model)
        try:
            body.check_supported()
            body.check_limits(self.limits)
            prompts: list[Prompt] = list(body.prompts(self.limits))
            self.check_token_prompts(prompts, room=1)
            sampling = body.to_sampling(self.defaults)
            beams = body.beam_search_params(sampling, self.max_model_len)
        except ValueError as exc:
            raise APIError(str(exc), 400) from None
        render = CompletionRender(self, body, prompts)
        jobs = plan_jobs(prompts, sampling, body.prompt_options(), body.priority, lora)
        return self.generate(render, jobs, sampling, body, arrival, beams)

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.perf_counter()
        body = await read_json(request, ChatCompletionRequest, self.limits)
        lora = self.check_model(body.model)
        try:
            body.check_supported()
            body.check_limits(self.limits)
            messages = body.chat_messages(self.limits)
            sampling = body.to_sampling(self.defaults)
            auto_tools = body.wants_auto_tools
            if auto_tools and not self.limits.enable_auto_tool_choice:
                raise ValueError(
                    '"auto" tool choice (the default with tools) needs a tool-call parser: '
                    "serve with --enable-auto-tool-choice --tool-call-parser, or use "
                    'tool_choice "required", a named function or "none"'
                )
            beams = body.beam_search_params(sampling, self.max_model_len)
        except ValueError as exc:
            raise APIError(str(exc), 400) from None
        # the parsers read tags (a call's, a reasoning's) that may be special tokens
        if auto_tools or keeps_special_tokens(self.limits.reasoning_parser):
            sampling = msgspec.structs.replace(sampling, skip_special_tokens=False)
        render = ChatRender(self, body, self.limits.tool_call_parser if auto_tools else None)
        jobs = plan_jobs([messages], sampling, body.prompt_options(), body.priority, lora)
        return self.generate(render, jobs, sampling, body, arrival, beams)

    async def embeddings(self, request: Request) -> Response:
        """Each input pooled into one vector by the engine (the engine's pooler_config), or
        the one conversation of `messages`."""
        arrival = time.perf_counter()
        body = await read_json(request, EmbeddingRequest, self.limits)
        lora = self.check_model(body.model)
        try:
            body.check_supported()
            prompts = body.prompts(self.limits)
            if body.messages is None:
                self.check_token_prompts(prompts, room=0)
            pooling, sampling = body.pooling_params(), body.to_sampling()
        except ValueError as exc:
            raise APIError(str(exc), 400) from None
        jobs = plan_jobs(prompts, sampling, body.prompt_options(), body.priority, lora, pooling)
        return self.pooled(EmbeddingRender(self, body), jobs, arrival)

    async def classify(self, request: Request) -> Response:
        """vLLM's /classify: each input's labels' probabilities, by a sequence classifier (the
        engine refuses it for a model without a classification head)."""
        arrival = time.perf_counter()
        body = await read_json(request, ClassificationRequest, self.limits)
        lora = self.check_model(body.model)
        try:
            prompts = body.prompts(self.limits)
            self.check_token_prompts(prompts, room=0)
            pooling, sampling = body.pooling_params(), body.to_sampling()
        except ValueError as exc:
            raise APIError(str(exc), 400) from None
        jobs = plan_jobs(prompts, sampling, body.prompt_options(), body.priority, lora, pooling)
        return self.pooled(ClassificationRender(self, body, self.classifier), jobs, arrival)

    async def score(self, request: Request) -> Response:
        """vLLM's /score: the score of text_1 and each of text_2 (the cosine similarity of
        their embeddings, or a cross-encoder's of the pair)."""
        return await self.scored(request, ScoreRequest, ScoreRender)

    async def rerank(self, request: Request) -> Response:
        """vLLM's /rerank: the documents by their score against the query, best first."""
        return await self.scored(request, RerankRequest, RerankRender)

    async def scored(
        self,
        request: Request,
        kind: type[ScoreRequest | RerankRequest],
        render_class: type[ScoreRender | RerankRender],
    ) -> Response:
        """The body's prompts pooled (an embedding model's distinct texts, a cross-encoder's
        pairs: api/scoring.py), answered with its pairs' scores."""
        arrival = time.perf_counter()
        body = await read_json(request, kind, self.limits)
        lora = self.check_model(body.model)
        try:
            plan, sampling = body.plan(self.limits, self.model_config), body.to_sampling()
        except ValueError as exc:
            raise APIError(str(exc), 400) from None
        prompts: list[Prompt] = list(plan.prompts)
        jobs = plan_jobs(prompts, sampling, PromptOptions(), body.priority, lora, plan.pooling())
        return self.pooled(render_class(self, body, plan), jobs, arrival)  # type: ignore[arg-type]

    def pooled(self, render: PooledRender, jobs: list[Job], arrival: float) -> GenerationResponse:
        """The response of pooling jobs, answered whole by `render`."""
        if not self.limits.disable_log_requests:
            prompts = logged_prompts(jobs, self.limits.max_log_len)
            logger.info("%s: %d engine request(s)%s, %s", render.id, len(jobs), prompts,
                        jobs[0].pooling)  # fmt: skip
        return GenerationResponse(self.client, self.metrics, render, jobs, False, False, arrival)

    def check_token_prompts(self, prompts: list[Prompt], room: int) -> None:
        """The prompts given as token ids, each leaving `room` tokens for output."""
        for prompt in prompts:
            if not isinstance(prompt, str):
                check_token_prompt(prompt, self.vocab_size, self.max_model_len, room)  # type: ignore[arg-type]

    def generate(
        self,
        render: Render,
        jobs: list[Job],
        sampling: SamplingParams,
        body: CompletionRequest | ChatCompletionRequest,
        arrival: float,
        beams: BeamSearchParams | None,
    ) -> GenerationResponse:
        if not self.limits.disable_log_requests:
            what = "engine request(s)" if beams is None else "beam(s) a step"
            prompts = logged_prompts(jobs, self.limits.max_log_len)
            logger.info("%s: %d %s%s, %s", render.id, len(jobs), what, prompts, sampling)
        source = open_choices
        if beams is not None:
            facts = BeamEngineFacts(
                self.eos_token_ids, self.max_model_len, self.text_of, sampling.logprobs
            )
            source = functools.partial(open_beams, params=beams, engine=facts)
        return GenerationResponse(
            self.client,
            self.metrics,
            render,
            jobs,
            body.stream,
            body.include_usage or self.limits.enable_force_include_usage,
            arrival,
            source,
        )

    def token_text(self, token_id: int) -> str:
        return self.text_of([token_id])

    def text_of(self, token_ids: list[int]) -> str:
        """Text of `token_ids`; empty without a tokenizer (skip_tokenizer_init)."""
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids)

    # ------------------------------------------------------------------ tokenizer endpoints

    async def tokenize(self, request: Request) -> Response:
        body = await read_json(request, TokenizeRequest, self.limits)
        self.check_model(body.model)
        tokenizer = self.require_tokenizer()
        try:
            texts = [body.prompt] if body.messages is None else [m.text() for m in body.messages]
            if (body.prompt is None) == (body.messages is None):
                raise ValueError("give either a prompt or messages")
            if sum(len(text or "") for text in texts) > self.limits.max_prompt_chars:
                raise ValueError(f"the input is at most {self.limits.max_prompt_chars} characters")
            if body.messages is not None:
                check_prompt_options(body.prompt_options())
        except ValueError as exc:
            raise APIError(str(exc), 400) from None
        async with self.tokenizer_lock:
            ids = await anyio.to_thread.run_sync(self.encode, tokenizer, body)
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        reply = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        return JSONResponse({**reply, "token_strs": strs})

    @staticmethod
    def encode(tokenizer: Any, body: TokenizeRequest) -> list[int]:
        """The prompt's ids, or the messages' through the chat template (as the engine gets
        them); runs in a worker thread."""
        if body.messages is None:
            add_special = body.add_special_tokens is not False
            return list(tokenizer.encode(body.prompt, add_special_tokens=add_special))
        messages = [m.to_wire() for m in body.messages]
        try:
            return apply_chat_template(tokenizer, messages, body.prompt_options())
        except ValueError as exc:
            raise APIError(str(exc), 400) from None

    async def detokenize(self, request: Request) -> Response:
        body = await read_json(request, DetokenizeRequest, self.limits)
        self.check_model(body.model)
        tokenizer = self.require_tokenizer()
        if any(not 0 <= t < self.vocab_size for t in body.tokens):
            raise APIError(f"token ids must be in [0, {self.vocab_size})", 400)
        async with self.tokenizer_lock:
            text = await anyio.to_thread.run_sync(tokenizer.decode, body.tokens)
        return JSONResponse({"prompt": text})

    def require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise APIError("this server has no tokenizer (skip_tokenizer_init)", 400)
        return self.tokenizer


def logged_prompts(jobs: list[Job], max_len: int) -> str:
    """The distinct prompts of `jobs` as the request log shows them (", prompts [...]"): text
    (a chat's messages as "role: content" lines) cut to `max_len` characters, token ids to
    `max_len` ids; "" for a `max_len` of 0."""
    if not max_len:
        return ""
    prompts: list[Prompt] = []
    for job in jobs:
        if not prompts or job.prompt is not prompts[-1]:  # a prompt's n choices share it
            prompts.append(job.prompt)
    return f", prompts {[_logged_prompt(prompt)[:max_len] for prompt in prompts]}"


def _logged_prompt(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, tuple):  # a cross-encoder's text pair
        return "\n".join(prompt)
    if isinstance(prompt, str) or not prompt or not isinstance(prompt[0], ChatMessage):
        return prompt  # type: ignore[return-value]
    return "\n".join(f"{m.role}: {m.content}" for m in prompt)  # type: ignore[union-attr]


def middleware(limits: ServerConfig) -> list[Middleware]:
    """CORS (outermost, so that preflights need no API key) where origins are allowed, then
    the API key check."""
    cors = []
    if limits.allowed_origins is not None:
        cors = [
            Middleware(
                CORSMiddleware,
                allow_origins=limits.allowed_origins,
                allow_methods=limits.allowed_methods,
                allow_headers=limits.allowed_headers,
                allow_credentials=limits.allow_credentials,
            )
        ]
    return [*cors, Middleware(APIKeyGuard, api_key=limits.api_key)]


def build_app(server: OpenAIServer) -> Starlette:
    return Starlette(
        routes=server.routes(),
        middleware=middleware(server.limits),
        exception_handlers={APIError: on_api_error, HTTPException: on_http_exception},
    )


class APIServerActor(Actor):
    """Runs uvicorn inside the actor's anyio loop on the listening socket the supervisor bound
    once (`listen_fd`): connections made while this actor restarts wait in its backlog."""

    name = "api-server"

    def prepare(self) -> None:
        self.tokenizer = None
        if not self.config.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(
                self.config.tokenizer_path,
                self.config.chat_template,
                use_fast=self.config.tokenizer_mode != "slow",
            )

    async def setup(self) -> dict:
        server_config = self.config.server
        assert server_config is not None, "serve needs a ServerConfig"
        if self.listen_fd >= 0:  # bound once by the supervisor: restarts keep the backlog
            self.listener = socket.socket(fileno=self.listen_fd)
        else:
            self.listener = socket.create_server((server_config.host, server_config.port))
        # Accepted connections inherit it. asyncio sets it only on sockets whose protocol
        # number is TCP's, which create_server's (0) is not: without it, a response's headers
        # and body (two writes) wait 40 ms for the client's delayed ACK (Nagle's algorithm).
        self.listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server_config = server_config
        self.engine_client: AsyncClient | None = None
        return {}

    def queue_depths(self) -> dict[str, int]:
        client = self.engine_client
        if client is None:
            return {}
        return {"requests": len(client.core.requests), "streams": client.num_streams}

    async def run(self) -> None:
        defaults = sampling_defaults(self.config)
        credentials = self.credentials.for_clients() if self.credentials else None
        async with AsyncClient(
            self.addresses.engine_address, connect_timeout_s=None, credentials=credentials
        ) as client:
            self.engine_client = client
            handler = OpenAIServer(
                client, self.config, self.tokenizer, defaults, state_dir=self.addresses.run_dir
            )
            handler.actor_status = AsyncStatusClient(self.addresses.engine_address, credentials)
            config = uvicorn.Config(
                build_app(handler),
                log_level=self.server_config.uvicorn_log_level,
                lifespan="off",
                timeout_graceful_shutdown=1,
                root_path=self.server_config.root_path,
                ssl_keyfile=self.server_config.ssl_keyfile,
                ssl_certfile=self.server_config.ssl_certfile,
                ssl_ca_certs=self.server_config.ssl_ca_certs,
            )
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(trim_heap_forever, self.server_config.heap_trim_interval_s)
                    await uvicorn.Server(config).serve(sockets=[self.listener])
                    tg.cancel_scope.cancel()
            finally:
                handler.actor_status.close()
