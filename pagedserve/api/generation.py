"""Running one API call's requests through the async ZeroMQ client: several prompts, n choices
each, merged into one stream of (choice index, delta). Shared by every HTTP endpoint."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import anyio.abc

from pagedserve.actors.messages import (
    LoRARequest,
    PoolingParams,
    PromptOptions,
    RequestDelta,
    SamplingParams,
    TokenLogprobs,
)
from pagedserve.api.client import AsyncClient
from pagedserve.api.client_core import Prompt, fan_out

Event = tuple[int, RequestDelta]  # (choice index, delta)
MERGE_BUFFER = 64  # events waiting for the consumer; a full buffer makes the pumps wait


@dataclass
class Choice:
    """Everything one choice has produced so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    embedding: bytes | None = None  # an embedding request's vector
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served

    def add(self, delta: RequestDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        if delta.prompt_token_ids is not None:
            self.prompt_token_ids = delta.prompt_token_ids
            self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.embedding is not None:
            self.embedding = delta.embedding
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason.openai_name
            self.stop_reason = delta.stop_reason


@dataclass(frozen=True)
class Job:
    """One engine request: choice `index` of the API call."""

    index: int
    prompt: Prompt
    sampling: SamplingParams
    options: PromptOptions
    priority: int = 0
    lora: LoRARequest | None = None
    pooling: PoolingParams | None = None  # an embedding of the prompt


def plan_jobs(
    prompts: list[Prompt],
    sampling: SamplingParams,
    options: PromptOptions,
    priority: int = 0,
    lora: LoRARequest | None = None,
    pooling: PoolingParams | None = None,
) -> list[Job]:
    """Choice index = prompt index * n + child index."""
    jobs = []
    for p_index, prompt in enumerate(prompts):
        for c_index, child in enumerate(fan_out(sampling)):
            index = p_index * sampling.n + c_index
            jobs.append(Job(index, prompt, child, options, priority, lora, pooling))
    return jobs


@asynccontextmanager
async def open_choices(client: AsyncClient, jobs: list[Job]) -> AsyncIterator[AsyncIterator[Event]]:
    """The deltas of every job as they come, until each has finished; an engine error is
    raised from the iterator. The pumps (one task per job when there are several) live in a
    task group of the caller's own task for the duration of the `async with` block, and
    leaving the block early (an error, a cancelled request) aborts every unfinished job."""
    if len(jobs) == 1:
        job = jobs[0]
        deltas = _generate(client, job)
        try:
            yield _tagged(job.index, deltas)
        finally:
            await deltas.aclose()
        return
    send, receive = anyio.create_memory_object_stream[Event | Exception](MERGE_BUFFER)
    error: Exception | None = None
    async with send, receive, anyio.create_task_group() as tg:
        for job in jobs:
            tg.start_soon(_pump, client, job, send)
        try:
            yield _merged(receive, len(jobs))
        except Exception as exc:  # re-raised below as itself, not in the task group's group
            error = exc
        finally:
            tg.cancel_scope.cancel()
    if error is not None:
        raise error


def _generate(client: AsyncClient, job: Job) -> AsyncIterator[RequestDelta]:
    """The job's engine request: its deltas."""
    return client.generate(
        job.prompt, job.sampling, options=job.options, priority=job.priority, lora=job.lora,
        pooling=job.pooling,
    )  # fmt: skip


async def _tagged(index: int, deltas: AsyncIterator[RequestDelta]) -> AsyncIterator[Event]:
    async for delta in deltas:
        yield index, delta


async def _pump(
    client: AsyncClient, job: Job, send: anyio.abc.ObjectSendStream[Event | Exception]
) -> None:
    try:
        async for delta in _generate(client, job):
            await send.send((job.index, delta))
    except Exception as exc:  # raised in the consumer, which leaves and so cancels the rest
        await send.send(exc)


async def _merged(
    receive: anyio.abc.ObjectReceiveStream[Event | Exception], num_jobs: int
) -> AsyncIterator[Event]:
    remaining = num_jobs
    while remaining:
        item = await receive.receive()
        if isinstance(item, Exception):
            raise item
        remaining -= item[1].finish_reason is not None
        yield item
