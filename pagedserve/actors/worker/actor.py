"""The worker process: one per device. Executes step plans in order; rank 0 reports samples."""

from __future__ import annotations

from pagedserve.actors import bus
from pagedserve.actors.actor import Actor
from pagedserve.actors.messages import SchedulerInbound, Shutdown, StepPlan, WorkerInbound
from pagedserve.actors.worker.model_runner import ModelRunner


class WorkerActor(Actor):
    name = "worker"

    async def setup(self) -> dict:
        self.runner = ModelRunner(self.config, self.rank)
        self.runner.load_model()
        num_blocks = self.runner.num_kv_blocks()
        self.runner.init_kv_cache(num_blocks)
        self.inbox: bus.Receiver[WorkerInbound] = bus.Receiver(
            self.ctx, self.addresses.worker_inbox(self.rank), WorkerInbound
        )
        self.to_scheduler: bus.Sender[SchedulerInbound] | None = None
        if self.rank == 0:
            self.to_scheduler = bus.Sender(self.ctx, self.addresses.scheduler_inbox)
        return {"num_kv_blocks": num_blocks}

    async def run(self) -> None:
        while True:
            message = await self.inbox.recv()
            if isinstance(message, Shutdown):
                return
            await self.execute(message)

    async def execute(self, plan: StepPlan) -> None:
        self.num_messages += 1
        result = self.runner.execute(plan)
        if self.to_scheduler is not None:
            await self.to_scheduler.send(result)
