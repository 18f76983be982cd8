"""The scheduler process: requests and step results in, step plans and engine outputs out.

It keeps up to `max_inflight_steps` plans at the workers, so it plans step N+1 while step N
runs (decode needs exactly one more slot per running request, whatever step N samples); with
pipeline parallelism, enough for every stage (layout.plans_in_flight). It binds the workers'
plan channels (a worker may run on another machine: it connects).
Everything a step produced for the clients (new routes, tokens, refusals) leaves in one
`EngineOutputs` frame to the detokenizer.

It tracks the ids of the steps in flight: a result for any other step (of a previous
scheduler, or of workers that were lost) is ignored. When the supervisor says the workers are
lost, it takes every running request back to waiting and plans nothing until they are ready
again; its next plan then resets them (as a new scheduler's first plan does).
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
    WorkersLost,
    WorkersReady,
)
from pagedserve.actors.scheduler.scheduler import Scheduler
from pagedserve.actors.timeline import Timeline
from pagedserve.layout import plans_in_flight


class SchedulerActor(Actor):
    name = "scheduler"
    timer = LoopTimer()
    timeline: Timeline | None = None

    async def setup(self) -> dict:
        self.timer = LoopTimer()
        if self.config.profile is not None:
            self.timeline = Timeline()
        assert self.config.num_kv_blocks, "the supervisor sizes the scheduler"
        self.scheduler = Scheduler(self.config, self.config.num_kv_blocks, self.epoch)
        self.inbox: bus.Receiver[SchedulerInbound] = bus.Receiver(
            self.ctx,
            self.addresses.scheduler_inbox,
            SchedulerInbound,
            poll_first_s=bus.POLL_FIRST_S,
            spin_s=self.config.spin_seconds,
        )
        self.to_detokenizer: bus.Sender[DetokenizerInbound] = bus.Sender(
            self.ctx, self.addresses.detokenizer_inbox
        )
        self.to_workers: list[bus.Sender[WorkerInbound]] = [
            bus.Sender(self.ctx, self.addresses.worker_inbox(rank), bind=True)
            for rank in range(self.config.world_size)
        ]
        self.inflight: set[int] = set()  # ids of the steps at the workers
        self.max_inflight = plans_in_flight(self.config)
        self.workers_ready = True
        return {}

    def queue_depths(self) -> dict[str, int]:
        return {
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "inflight_steps": len(self.inflight),
        }

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
            if outputs.outputs:  # tokens first: their clients wait for them
                await self.send_outputs(outputs)
                await self.plan_ahead()
            else:  # new requests' first steps first: their routes are needed with tokens only
                await self.plan_ahead()
                await self.send_outputs(outputs)

    async def send_outputs(self, outputs: EngineOutputs) -> None:
        with self.timer.phase("send_outputs"):
            if outputs.routes or outputs.outputs or outputs.errors:
                if self.timeline is not None:  # marked first: the receiver may be quicker
                    self.timeline.mark_all("output_sent", (o.handle for o in outputs.outputs))
                await self.to_detokenizer.send(outputs)

    def close(self) -> None:
        if self.config.profile is not None:
            directory = self.config.profile.output_dir
            self.timer.write(os.path.join(directory, "scheduler.loop.json"))
            if self.timeline is not None:
                self.timeline.write(os.path.join(directory, "scheduler.timeline.json"))
        super().close()

    async def handle(
        self,
        message: AddRequest
        | AbortRequest
        | StatsRequest
        | StopRequests
        | StepResult
        | WorkersLost
        | WorkersReady,
        outputs: EngineOutputs,
    ) -> None:
        scheduler = self.scheduler
        if isinstance(message, StepResult):
            if self.timeline is not None:
                self.timeline.mark("result_in", message.step_id)
            if message.step_id in self.inflight:  # else a lost step's, or an old scheduler's
                self.inflight.remove(message.step_id)
                outputs.outputs += scheduler.update_from_result(message)
        elif isinstance(message, (WorkersLost, WorkersReady)):
            self.workers_ready = isinstance(message, WorkersReady)
            if not self.workers_ready:
                self.inflight.clear()
                scheduler.forget_workers()
        elif isinstance(message, AddRequest):
            accepted = scheduler.add_request(message)
            if isinstance(accepted, RequestError):
                outputs.errors.append(accepted)
            else:
                outputs.routes.append(accepted)
                if self.timeline is not None:
                    self.timeline.mark("arrived", accepted.handle)
        elif isinstance(message, AbortRequest):
            outputs.outputs += scheduler.abort_requests(message.client, message.seqs)
        elif isinstance(message, StopRequests):
            scheduler.stop_requests(message.handles)
        else:
            stats = scheduler.stats()
            stats.client, stats.seq = message.client, message.seq
            await self.to_detokenizer.send(stats)

    async def plan_ahead(self) -> None:
        with self.timer.phase("plan"):
            while self.workers_ready and len(self.inflight) < self.max_inflight:
                plan = self.scheduler.schedule()
                if plan is None:
                    return
                await self.broadcast(plan)
                self.inflight.add(plan.step_id)

    async def broadcast(self, plan: StepPlan) -> None:
        frame = bus.encode(plan)  # once for every worker
        if self.timeline is not None:  # marked before the send: a worker may take it at once
            self.timeline.mark("plan_sent", plan.step_id)
            self.timeline.mark_all("scheduled", (r.handle for r in plan.new_requests), plan.step_id)
        for sender in self.to_workers:
            await sender.send_frame(frame)
