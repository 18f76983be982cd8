"""The scheduler process: requests and step results in, step plans and engine outputs out.

It keeps up to `max_inflight_steps` plans at the workers, so it plans step N+1 while step N
runs (decode needs exactly one more slot per running request, whatever step N samples); with
pipeline parallelism, enough for every stage (layout.plans_in_flight). It binds the workers'
plan channels (a worker may run on another machine: it connects).
Everything a step produced for the clients (new routes, tokens, refusals) leaves in one
`EngineOutputs` frame to the detokenizer.
"""

from __future__ import annotations

import os

from pagedserve.actors import bus
from pagedserve.actors.actor import Actor
from pagedserve.actors.loop_timer import LoopTimer
from pagedserve.actors.messages import (
    AbortRequest,
    AddRequest,
    DetokenizerInbound,
    EngineOutputs,
    RequestError,
    SchedulerInbound,
    Shutdown,
    StatsRequest,
    StepPlan,
    StepResult,
    StopRequests,
    WorkerInbound,
)
from pagedserve.actors.scheduler.scheduler import Scheduler
from pagedserve.layout import plans_in_flight


class SchedulerActor(Actor):
    name = "scheduler"
    timer = LoopTimer()

    async def setup(self) -> dict:
        self.timer = LoopTimer()
        assert self.config.num_kv_blocks, "the supervisor sizes the scheduler"
        self.scheduler = Scheduler(self.config, self.config.num_kv_blocks, self.epoch)
        self.inbox: bus.Receiver[SchedulerInbound] = bus.Receiver(
            self.ctx, self.addresses.scheduler_inbox, SchedulerInbound
        )
        self.to_detokenizer: bus.Sender[DetokenizerInbound] = bus.Sender(
            self.ctx, self.addresses.detokenizer_inbox
        )
        self.to_workers: list[bus.Sender[WorkerInbound]] = [
            bus.Sender(self.ctx, self.addresses.worker_inbox(rank), bind=True)
            for rank in range(self.config.world_size)
        ]
        self.num_inflight = 0
        self.max_inflight = plans_in_flight(self.config)
        return {}

    async def run(self) -> None:
        while True:
            with self.timer.phase("wait"):
                messages = [await self.inbox.recv(), *self.inbox.recv_ready()]
            outputs = EngineOutputs()
            with self.timer.phase("handle"):
                for message in messages:
                    if isinstance(message, Shutdown):
                        return
                    await self.handle(message, outputs)
            with self.timer.phase("send_outputs"):
                if outputs.routes or outputs.outputs or outputs.errors:
                    await self.to_detokenizer.send(outputs)
            with self.timer.phase("plan"):
                await self.plan_ahead()

    def close(self) -> None:
        if self.config.profile is not None:
            self.timer.write(os.path.join(self.config.profile.output_dir, "scheduler.loop.json"))
        super().close()

    async def handle(
        self,
        message: AddRequest | AbortRequest | StatsRequest | StopRequests | StepResult,
        outputs: EngineOutputs,
    ) -> None:
        scheduler = self.scheduler
        if isinstance(message, StepResult):
            self.num_inflight -= 1
            outputs.outputs += scheduler.update_from_result(message)
        elif isinstance(message, AddRequest):
            accepted = scheduler.add_request(message)
            if isinstance(accepted, RequestError):
                outputs.errors.append(accepted)
            else:
                outputs.routes.append(accepted)
        elif isinstance(message, AbortRequest):
            outputs.outputs += scheduler.abort_requests(message.client, message.seqs)
        elif isinstance(message, StopRequests):
            scheduler.stop_requests(message.handles)
        else:
            stats = scheduler.stats()
            stats.client, stats.seq = message.client, message.seq
            await self.to_detokenizer.send(stats)

    async def plan_ahead(self) -> None:
        while self.num_inflight < self.max_inflight:
            plan = self.scheduler.schedule()
            if plan is None:
                return
            await self.broadcast(plan)
            self.num_inflight += 1

    async def broadcast(self, plan: StepPlan) -> None:
        for sender in self.to_workers:
            await sender.send(plan)
