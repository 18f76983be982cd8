"""The tokenizer process: text in (tokenize, chat template, validate), text out (incremental
detokenization, stop strings). It is the engine's front door: clients talk to it over a ROUTER
socket, and it routes every delta back to the client that asked.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pagedserve.actors import bus
from pagedserve.actors.actor import Actor
from pagedserve.actors.chat import apply_chat_template, eos_token_ids, load_tokenizer
from pagedserve.actors.detokenizer import DetokenizeResult, IncrementalDetokenizer
from pagedserve.actors.messages import (
    AbortRequest,
    AddRequest,
    ClientInbound,
    DeltaBatch,
    EngineOutputs,
    FinishReason,
    GenerateRequest,
    RequestDelta,
    RequestError,
    RequestOutput,
    SchedulerInbound,
    SchedulerStats,
    Shutdown,
    TokenizerInbound,
)
from pagedserve.config import read_hf_config

logger = logging.getLogger(__name__)


class NullDetokenizer:
    """For engines without a tokenizer: token ids only, no text, no stop strings."""

    def update(self, new_token_ids: list[int], finished: bool) -> DetokenizeResult:
        return DetokenizeResult("")


@dataclass
class LiveRequest:
    client: bytes
    detokenizer: IncrementalDetokenizer | NullDetokenizer
    prompt_token_ids: list[int]
    first_delta_sent: bool = False


class TokenizerActor(Actor):
    name = "tokenizer"

    async def setup(self) -> dict:
        if self.config.skip_tokenizer_init:
            self.tokenizer = None
            self.eos_token_ids = eos_token_ids(self.config.model_path, None)
            self.vocab_size = int(read_hf_config(self.config.model_path)["vocab_size"])
        else:
            self.tokenizer = load_tokenizer(self.config.tokenizer_path)
            self.eos_token_ids = eos_token_ids(self.config.model_path, self.tokenizer)
            self.vocab_size = len(self.tokenizer)
        self.clients: bus.Router[ClientInbound] = bus.Router(
            self.ctx, self.addresses.tokenizer_clients, ClientInbound
        )
        self.inbox: bus.Receiver[TokenizerInbound] = bus.Receiver(
            self.ctx, self.addresses.tokenizer_inbox, TokenizerInbound
        )
        self.to_scheduler: bus.Sender[SchedulerInbound] = bus.Sender(
            self.ctx, self.addresses.scheduler_inbox
        )
        self.live: dict[str, LiveRequest] = {}
        self.stats_waiters: dict[str, bytes] = {}
        return {}

    async def run(self) -> None:
        import anyio

        async with anyio.create_task_group() as tg:
            tg.start_soon(self.serve_clients)
            await self.serve_scheduler()
            tg.cancel_scope.cancel()

    async def serve_clients(self) -> None:
        while True:
            client, message = await self.clients.recv()
            if isinstance(message, GenerateRequest):
                await self.on_generate(client, message)
            elif isinstance(message, AbortRequest):
                await self.to_scheduler.send(message)
            else:
                self.stats_waiters[message.request_id] = client
                await self.to_scheduler.send(message)

    async def serve_scheduler(self) -> None:
        while True:
            message = await self.inbox.recv()
            if isinstance(message, Shutdown):
                return
            if isinstance(message, SchedulerStats):
                await self.on_stats(message)
            else:
                await self.on_outputs(message)

    # ------------------------------------------------------------------ requests in

    async def on_generate(self, client: bytes, request: GenerateRequest) -> None:
        try:
            prompt_ids = self.prompt_token_ids(request)
        except ValueError as exc:
            await self.clients.send(client, RequestError(request.request_id, str(exc), 400))
            return
        detokenizer = (
            NullDetokenizer()
            if self.tokenizer is None
            else IncrementalDetokenizer(self.tokenizer, prompt_ids, request.sampling)
        )
        self.live[request.request_id] = LiveRequest(client, detokenizer, prompt_ids)
        await self.to_scheduler.send(
            AddRequest(
                request_id=request.request_id,
                prompt_token_ids=prompt_ids,
                sampling=request.sampling,
                eos_token_ids=self.eos_token_ids,
                arrival_time=time.time(),
            )
        )

    def prompt_token_ids(self, request: GenerateRequest) -> list[int]:
        """Tokenize and validate; every ValueError becomes a 400 for the client."""
        if request.request_id in self.live:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if self.tokenizer is None and request.prompt_token_ids is None:
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init): send token ids")
        if request.messages is not None:
            ids = apply_chat_template(
                self.tokenizer, request.messages, request.add_generation_prompt
            )
        elif request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
        elif request.prompt is not None:
            ids = self.tokenizer.encode(request.prompt)
        else:
            raise ValueError("a request needs a prompt, prompt token ids or chat messages")
        if not ids:
            raise ValueError("the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        max_len = self.config.max_model_len or 0
        if len(ids) >= max_len:
            raise ValueError(
                f"This model's maximum context length is {max_len} tokens; the prompt has "
                f"{len(ids)} tokens, which leaves no room for output."
            )
        return ids

    # ------------------------------------------------------------------ outputs out

    async def on_outputs(self, message: EngineOutputs) -> None:
        """One frame per client per step: the deltas of all its requests."""
        batches: dict[bytes, list[RequestDelta]] = {}
        for output in message.outputs:
            live = self.live.get(output.request_id)
            if live is not None:
                batches.setdefault(live.client, []).append(await self.make_delta(output, live))
        for client, deltas in batches.items():
            await self.clients.send(client, DeltaBatch(deltas))

    async def make_delta(self, output: RequestOutput, live: LiveRequest) -> RequestDelta:
        finish, stop_reason = output.finish_reason, output.stop_reason
        result = live.detokenizer.update(output.new_token_ids, finished=finish is not None)
        if result.stop_string is not None and finish is None:
            finish, stop_reason = FinishReason.STOP, result.stop_string
            await self.to_scheduler.send(AbortRequest([output.request_id]))
        delta = RequestDelta(
            request_id=output.request_id,
            text=result.text_delta,
            token_ids=output.new_token_ids,
            logprobs=output.new_logprobs,
            finish_reason=finish,
            stop_reason=result.stop_string if result.stop_string is not None else stop_reason,
        )
        if not live.first_delta_sent:
            delta.prompt_token_ids = live.prompt_token_ids
            delta.num_cached_tokens = output.num_cached_tokens
            live.first_delta_sent = True
        if finish is not None:
            del self.live[output.request_id]
        return delta

    async def on_stats(self, stats: SchedulerStats) -> None:
        client = self.stats_waiters.pop(stats.request_id, None)
        if client is not None:
            await self.clients.send(client, stats)
