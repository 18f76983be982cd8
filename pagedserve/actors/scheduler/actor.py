"""The scheduler process: requests and step results in, step plans and token outputs out.

It keeps up to `max_inflight_steps` plans at the workers, so it plans step N+1 while step N
runs (decode needs exactly one more slot per running request, whatever step N samples).
"""

from __future__ import annotations

import logging
import os

from pagedserve.actors import bus
from pagedserve.actors.actor import Actor
from pagedserve.actors.loop_timer import LoopTimer
from pagedserve.actors.messages import (
    AbortRequest,
    AddRequest,
    EngineOutputs,
    FinishReason,
    RequestOutput,
    SchedulerInbound,
    Shutdown,
    StatsRequest,
    StepPlan,
    StepResult,
    TokenizerInbound,
    WorkerInbound,
)
from pagedserve.actors.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class SchedulerActor(Actor):
    name = "scheduler"
    timer = LoopTimer()

    async def setup(self) -> dict:
        self.timer = LoopTimer()
        assert self.config.num_kv_blocks, "the supervisor sizes the scheduler"
        self.scheduler = Scheduler(self.config, self.config.num_kv_blocks)
        self.inbox: bus.Receiver[SchedulerInbound] = bus.Receiver(
            self.ctx, self.addresses.scheduler_inbox, SchedulerInbound
        )
        self.to_tokenizer: bus.Sender[TokenizerInbound] = bus.Sender(
            self.ctx, self.addresses.tokenizer_inbox
        )
        self.to_workers: list[bus.Sender[WorkerInbound]] = [
            bus.Sender(self.ctx, self.addresses.worker_inbox(rank))
            for rank in range(self.config.tensor_parallel_size)
        ]
        self.num_inflight = 0
        return {}

    async def run(self) -> None:
        while True:
            with self.timer.phase("wait"):
                messages = [await self.inbox.recv(), *self.inbox.recv_ready()]
            outputs: list[RequestOutput] = []
            with self.timer.phase("handle"):
                for message in messages:
                    if isinstance(message, Shutdown):
                        return
                    outputs += await self.handle(message)
            with self.timer.phase("send_outputs"):
                if outputs:
                    await self.to_tokenizer.send(EngineOutputs(outputs))
            with self.timer.phase("plan"):
                await self.plan_ahead()

    def close(self) -> None:
        if self.config.profile is not None:
            self.timer.write(os.path.join(self.config.profile.output_dir, "scheduler.loop.json"))
        super().close()

    async def handle(
        self, message: AddRequest | AbortRequest | StatsRequest | StepResult
    ) -> list[RequestOutput]:
        if isinstance(message, StepResult):
            self.num_inflight -= 1
            return self.scheduler.update_from_result(message)
        if isinstance(message, AddRequest):
            return self.add(message)
        if isinstance(message, AbortRequest):
            return self.scheduler.abort_requests(message.request_ids)
        stats = self.scheduler.stats()
        stats.request_id = message.request_id
        await self.to_tokenizer.send(stats)
        return []

    def add(self, request: AddRequest) -> list[RequestOutput]:
        try:
            self.scheduler.add_request(request)
        except ValueError as exc:  # the tokenizer validates first; never die on a bad request
            logger.error("rejected request %s: %s", request.request_id, exc)
            return [RequestOutput(request.request_id, [], None, FinishReason.ABORT, None, 0)]
        return []

    async def plan_ahead(self) -> None:
        while self.num_inflight < self.config.max_inflight_steps:
            plan = self.scheduler.schedule()
            if plan is None:
                return
            await self.broadcast(plan)
            self.num_inflight += 1

    async def broadcast(self, plan: StepPlan) -> None:
        for sender in self.to_workers:
            await sender.send(plan)
