"""Offline batch generation: `LLM(model).generate(prompts, SamplingParams(...))`.

It starts the same actor processes as the server (tokenizer, scheduler, workers), submits every
prompt at once through the ZeroMQ client and gathers the streamed deltas into vLLM-shaped
`RequestOutput`s, in prompt order.
"""

from __future__ import annotations

import atexit
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from pagedserve.actors.messages import ChatMessage, RequestDelta, RequestError, SamplingParams
from pagedserve.actors.supervisor import EngineDeadError, Supervisor
from pagedserve.api.client import Client
from pagedserve.api.client_core import EngineRequestError, Prompt, fan_out
from pagedserve.config import DEFAULT_MODEL, EngineConfig
from pagedserve.outputs import CompletionOutput, RequestOutput

PromptInput = str | list[int] | dict[str, Any]
POLL_MS = 500


class LLM:
    """Keyword arguments are EngineConfig fields, named like the CLI flags and vLLM's
    (`tensor_parallel_size`, `max_model_len`, `block_size`, `max_num_seqs`, ...)."""

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any) -> None:
        self.config = EngineConfig(model=model, **engine_args)
        self.supervisor = Supervisor(self.config)
        self.supervisor.start()
        self.client = Client(
            self.supervisor.addresses.engine_address,
            credentials=self.supervisor.credentials.for_clients(),
        )
        self._request_counter = itertools.count()
        atexit.register(self.shutdown)

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        items = [_to_prompt(p) for p in _as_list(prompts)]
        return self._run(items, sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        items: list[tuple[str | None, Prompt]] = [
            (None, [ChatMessage(m["role"], m["content"]) for m in conv])  # type: ignore[index]
            for conv in conversations
        ]
        return self._run(items, sampling_params, use_tqdm)

    def get_stats(self):  # -> SchedulerStats
        return self.client.stats()

    def _run(
        self,
        items: list[tuple[str | None, Prompt]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        params = _per_prompt(sampling_params, len(items))
        results, owners = self._submit(items, params)
        bar = tqdm(total=len(results), desc="generate", disable=not use_tqdm or len(items) < 16)
        try:
            remaining = len(owners)
            while remaining:
                remaining -= self._apply(self._next_message(), results, owners, bar)
        except BaseException:
            self.client.abort_seqs(list(owners))
            raise
        finally:
            bar.close()
        return results

    def _submit(
        self, items: list[tuple[str | None, Prompt]], params: list[SamplingParams]
    ) -> tuple[list[RequestOutput], dict[int, tuple[int, int]]]:
        """Send every request; the results to fill and, per engine request (seq), its place."""
        results: list[RequestOutput] = []
        owners: dict[int, tuple[int, int]] = {}
        for index, ((text, prompt), sampling) in enumerate(zip(items, params)):
            request_id = str(next(self._request_counter))
            children = fan_out(sampling)
            outputs = [CompletionOutput(index=i) for i in range(len(children))]
            results.append(RequestOutput(request_id, text, [], outputs))
            for child_index, child in enumerate(children):
                seq = self.client.submit(prompt, child, label=request_id)
                owners[seq] = (index, child_index)
        return results, owners

    def _next_message(self) -> RequestDelta | RequestError:
        while True:
            if self.supervisor.dead_reason is not None:
                raise EngineDeadError(self.supervisor.dead_reason)
            message = self.client.receive(POLL_MS)
            if isinstance(message, (RequestDelta, RequestError)):
                return message

    @staticmethod
    def _apply(
        message: RequestDelta | RequestError,
        results: list[RequestOutput],
        owners: dict[int, tuple[int, int]],
        bar: tqdm,
    ) -> int:
        """Fold one delta into its result; returns how many engine requests finished (0/1)."""
        if message.seq not in owners:
            return 0
        if isinstance(message, RequestError):
            raise EngineRequestError(message.message, message.status_code)
        index, child = owners[message.seq]
        result = results[index]
        if message.prompt_token_ids is not None:
            result.prompt_token_ids = message.prompt_token_ids
            result.num_cached_tokens = message.num_cached_tokens
        result.outputs[child].add(message)
        if message.finish_reason is None:
            return 0
        del owners[message.seq]
        if result.finished:
            bar.update(1)
        return 1

    def shutdown(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()
            self.client = None  # type: ignore[assignment]
        if getattr(self, "supervisor", None) is not None:
            self.supervisor.stop()
        atexit.unregister(self.shutdown)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


def _as_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    return list(prompts)  # type: ignore[arg-type]


def _to_prompt(prompt: PromptInput) -> tuple[str | None, Prompt]:
    if isinstance(prompt, str):
        return prompt, prompt
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return None, list(prompt["prompt_token_ids"])
        return prompt["prompt"], prompt["prompt"]
    return None, list(prompt)


def _per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    if len(sampling_params) != count:
        raise ValueError("give one SamplingParams, or one per prompt")
    return list(sampling_params)
