"""Running one API call's requests through the async ZeroMQ client: several prompts, n choices
each, merged into one stream of (choice index, delta). Shared by every HTTP endpoint."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio

from pagedserve.actors.messages import RequestDelta, SamplingParams, TokenLogprobs
from pagedserve.api.client import AsyncClient
from pagedserve.api.client_core import Prompt, fan_out


@dataclass
class Choice:
    """Everything one choice has produced so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, delta: RequestDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        if delta.prompt_token_ids is not None:
            self.prompt_token_ids = delta.prompt_token_ids
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason.openai_name
            self.stop_reason = delta.stop_reason


async def stream_choices(
    client: AsyncClient, prompts: list[Prompt], sampling: SamplingParams
) -> AsyncIterator[tuple[int, RequestDelta]]:
    """Deltas of every choice as they come; choice index = prompt index * n + child index.
    Leaving early (or a client disconnect cancelling us) aborts every unfinished request."""
    jobs = []
    for p_index, prompt in enumerate(prompts):
        for c_index, child in enumerate(fan_out(sampling)):
            jobs.append((p_index * sampling.n + c_index, prompt, child))
    if len(jobs) == 1:
        index, prompt, child = jobs[0]
        async for delta in client.generate(prompt, child):
            yield index, delta
        return
    send, receive = anyio.create_memory_object_stream[tuple[int, RequestDelta] | BaseException](
        max_buffer_size=1 << 20
    )

    async def pump(index: int, prompt: Prompt, child: SamplingParams) -> None:
        try:
            async for delta in client.generate(prompt, child):
                await send.send((index, delta))
        except Exception as exc:  # surfaced to the consumer, which cancels the rest
            await send.send(exc)

    async with anyio.create_task_group() as tg:
        for job in jobs:
            tg.start_soon(pump, *job)
        remaining = len(jobs)
        async with receive:
            while remaining:
                item = await receive.receive()
                if isinstance(item, BaseException):
                    tg.cancel_scope.cancel()
                    raise item
                remaining -= item[1].finish_reason is not None
                yield item
        tg.cancel_scope.cancel()


async def collect_choices(
    client: AsyncClient, prompts: list[Prompt], sampling: SamplingParams
) -> list[Choice]:
    choices = [Choice(i) for i in range(len(prompts) * sampling.n)]
    async for index, delta in stream_choices(client, prompts, sampling):
        choices[index].add(delta)
    return choices
