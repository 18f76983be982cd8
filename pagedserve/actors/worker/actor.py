"""The worker process: one per device. Executes step plans in order; the last pipeline stage's
first tensor-parallel rank (rank 0 without pipeline parallelism) reports samples.

Steps are pipelined: a plan is launched on the device before the previous step's sampled
tokens reach the host (the model runner feeds them to the new step on the device), so the
device always has the next step queued while the host prepares the one after.

A plan with `reset` (a new scheduler's first, or the first after the workers were restarted)
drops every request and step the worker holds; a new worker ignores plans until one resets it
(plans of a lost incarnation may still be queued), and plans of an older scheduler than the
one that reset it are ignored. A step is a declared blocking call for the heartbeat (it may
compile kernels)."""

from __future__ import annotations

import os
import sys
import time

from pagedserve.actors import bus
from pagedserve.actors.actor import Actor, process_title
from pagedserve.actors.messages import (
    EPOCH_SHIFT,
    SchedulerInbound,
    Shutdown,
    StepPlan,
    StepResult,
    WorkerInbound,
)
from pagedserve.actors.timeline import Timeline
from pagedserve.actors.worker import startup
from pagedserve.actors.worker.model_runner import ModelRunner
from pagedserve.actors.worker.parallel_groups import join_worker_groups
from pagedserve.actors.worker.profiling import LoopTimer, StepLog, StepProfiler, TritonCompileLog


def _seconds_since_process_start() -> float:
    """Seconds since the actor process's entry module began its imports (NaN outside one)."""
    launch = sys.modules.get("__main__")  # `python -m pagedserve.actors.launch`
    start = getattr(launch, "PROCESS_START", None)
    return float("nan") if start is None else round(time.perf_counter() - start, 3)


class WorkerActor(Actor):
    name = "worker"
    profiler: StepProfiler | None = None
    step_log: StepLog | None = None
    timeline: Timeline | None = None
    timer = LoopTimer()

    @property
    def title(self) -> str:
        return process_title(f"worker{self.rank}")  # every rank numbered: worker0, worker1...

    async def setup(self) -> dict:
        imports_s = _seconds_since_process_start()
        self.timer = LoopTimer()
        profiling = self.config.profile is not None and self.rank == 0
        compiles = TritonCompileLog()
        if profiling:
            compiles.install()
        groups = join_worker_groups(self.config, self.addresses.run_dir, self.rank, self.epoch)
        start = time.perf_counter()
        self.runner = ModelRunner(self.config, self.rank, groups)
        runner_init_s = round(time.perf_counter() - start, 3)
        self.runner.load_model()
        startup.compile_kernels_ahead(self.runner)
        num_blocks = startup.num_kv_blocks(self.runner)
        startup.init_kv_cache(self.runner, num_blocks)
        if self.runner.link is not None:  # each stage started up alone
            self.runner.link.connect()
        setup_s = {"imports": imports_s, "runner_init": runner_init_s}
        setup_s |= self.runner.setup_seconds
        if profiling:
            setup_s["triton_compile"] = round(compiles.total_seconds, 3)
            compiles.reset()  # the step log counts the run's compiles only
            self.step_log = StepLog(self.runner.device, compiles)
            assert self.config.profile is not None
            self.profiler = StepProfiler(self.config.profile, self.rank, self.runner.device)
            self.timeline = Timeline()
        self.inbox: bus.Receiver[WorkerInbound] = bus.Receiver(
            self.ctx, self.addresses.worker_inbox(self.rank), WorkerInbound, bind=False,
            poll_first_s=bus.POLL_FIRST_S, spin_s=self.config.spin_seconds,
        )  # fmt: skip
        self.scheduler_epoch: int | None = None  # of the plans accepted: since the last reset
        self.to_scheduler: bus.Sender[SchedulerInbound] | None = None
        if self.rank == groups.layout.reporting_rank:
            self.to_scheduler = bus.Sender(self.ctx, self.addresses.scheduler_inbox)
        return {"num_kv_blocks": num_blocks, "setup_s": setup_s}

    def close(self) -> None:
        import torch.distributed as dist

        if self.profiler is not None:
            self.profiler.stop()  # a window cut short by the shutdown
            self.timer.add("device_wait", self.runner.device_wait_s)
            assert self.config.profile is not None
            directory = self.config.profile.output_dir
            self.timer.write(os.path.join(directory, "worker0.loop.json"))
            if self.step_log is not None:
                self.step_log.write(os.path.join(directory, "worker0.steps.json"))
            if self.timeline is not None:
                self.timeline.write(os.path.join(directory, "worker0.timeline.json"))
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        if hasattr(self, "runner"):  # a worker that failed before making it has none
            self.runner.close()
        super().close()

    async def run(self) -> None:
        """Launch each plan as it comes; report a step's result once the next step is queued
        on the device behind it, or as soon as no plan is waiting. The inbox polls first
        (bus.POLL_FIRST_S): the loop has nothing else to do while the worker waits for a plan."""
        while True:
            if self.runner.pending is not None and not self.inbox.has_ready():
                with self.timer.phase("finish"), self.liveness.blocking("step"):
                    result = self.runner.finish()
                await self.report(result)
            with self.timer.phase("wait_for_plan"):
                message = await self.inbox.recv()
            if isinstance(message, Shutdown):
                return
            if self.accept(message):
                with self.liveness.blocking("step"):  # with the profiler's trace export
                    result = self.launch(message)
                await self.report(result)

    def accept(self, plan: StepPlan) -> bool:
        """Whether to run `plan` (see the module docstring); a reset plan resets first."""
        epoch = plan.step_id >> EPOCH_SHIFT
        if plan.reset and (self.scheduler_epoch is None or epoch >= self.scheduler_epoch):
            self.scheduler_epoch = epoch
            with self.liveness.blocking("reset"):
                self.runner.finish()  # the step in flight belongs to the plans dropped now
            for handle in list(self.runner.input_batch.row_of):
                self.runner.input_batch.remove_request(handle)
            return True
        return not plan.reset and epoch == self.scheduler_epoch

    def queue_depths(self) -> dict[str, int]:
        return {"batch": len(self.runner.input_batch.row_of)}

    def launch(self, plan: StepPlan) -> StepResult | None:
        """runner.launch, inside the profiling hooks when they are on."""
        if self.profiler is not None:
            self.profiler.on_launch()
        if self.timeline is not None:
            self.timeline.mark("plan_in", plan.step_id)
        if self.step_log is not None:
            self.step_log.begin(plan.num_scheduled_tokens)
        with self.timer.phase("launch"):
            result = self.runner.launch(plan)
        if self.step_log is not None:
            self.step_log.end()
        if self.timeline is not None:
            self.timeline.mark("launched", plan.step_id)
        return result

    async def report(self, result: StepResult | None) -> None:
        if result is not None and self.to_scheduler is not None:
            if self.timeline is not None:
                self.timeline.mark("sampled", result.step_id)
            with self.timer.phase("report"):
                await self.to_scheduler.send(result)
