"""The worker process: one per device. Executes step plans in order; rank 0 reports samples."""

from __future__ import annotations

from pagedserve.actors import bus
from pagedserve.actors.actor import Actor
from pagedserve.actors.messages import SchedulerInbound, Shutdown, StepPlan, WorkerInbound
from pagedserve.actors.worker.model_runner import ModelRunner


class WorkerActor(Actor):
    name = "worker"

    async def setup(self) -> dict:
        self.join_tensor_parallel_group()
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

    def join_tensor_parallel_group(self) -> None:
        """With tensor_parallel_size > 1 the workers form one torch.distributed group (NCCL on
        GPUs, gloo on the CPU); the parallel linear layers shard by its rank and size."""
        size = self.config.tensor_parallel_size
        if size == 1:
            return
        import os

        import torch.distributed as dist

        dist.init_process_group(
            "nccl" if self.config.device == "cuda" else "gloo",
            init_method=f"file://{os.path.join(self.addresses.run_dir, 'tp-group')}",
            rank=self.rank,
            world_size=size,
        )

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        super().close()

    async def run(self) -> None:
        while True:
            message = await self.inbox.recv()
            if isinstance(message, Shutdown):
                return
            await self.execute(message)

    async def execute(self, plan: StepPlan) -> None:
        result = self.runner.execute(plan)
        if self.to_scheduler is not None:
            await self.to_scheduler.send(result)
