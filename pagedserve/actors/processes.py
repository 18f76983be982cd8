"""The actor processes of one engine: start (from a standby when there is one), kill, reap.

Each actor runs `python -m pagedserve.actors.launch NAME` and gets its `ActorLaunch` on
standard input (never argv or the environment: it holds the run's keys). With standby
processes on, the supervisor keeps one process per actor kind that has done its imports and
waits for a launch; a restart hands the launch to it and starts the next standby, so the
restart skips the imports (seconds of torch or transformers).

Workers are started by the engine's executor (executors.py: here, or on a Ray node), which
places each rank; so a worker's standby is prepared for its rank, where that rank runs. The
other actors are children of the supervisor, and any standby of theirs serves rank 0.
"""

from __future__ import annotations

import subprocess
import time

from pagedserve.actors import launch
from pagedserve.actors.actor import ActorLaunch, ActorStart
from pagedserve.actors.executors import WorkerExecutor

STOP_TIMEOUT_S = 10.0


def label_of(name: str, rank: int) -> str:
    return name if rank == 0 else f"{name}-{rank}"


class ActorProcesses:
    def __init__(self, executor: WorkerExecutor, pass_fds: tuple[int, ...] = ()) -> None:
        self.running: dict[str, subprocess.Popen] = {}  # by label
        self.spawned_at: dict[str, float] = {}
        self._standby: dict[str, subprocess.Popen] = {}  # by label
        self._executor = executor
        self._pass_fds = pass_fds

    def spawn(self, spec: ActorLaunch, rank: int, epoch: int) -> str:
        """Start actor `spec.name` of `rank`: in a prepared standby process if one is alive."""
        label = label_of(spec.name, rank)
        spare = self._standby.pop(label, None)
        start = launch.frame(ActorStart(rank=rank, epoch=epoch))
        process = spare if spare is not None and spare.poll() is None else self._popen(spec, rank)
        if not self._write(process, start):  # the standby died meanwhile: start afresh
            process = self._popen(spec, rank)
            self._write(process, start)
        self.running[label] = process
        self.spawned_at[label] = time.monotonic()
        return label

    def prepare_standby(self, spec: ActorLaunch, count: int = 1) -> None:
        """Keep a prepared standby process of actor `spec.name` for each of ranks
        0..count - 1 (a worker group needs one a rank)."""
        for rank in range(count):
            label = label_of(spec.name, rank)
            spare = self._standby.get(label)
            if spare is None or spare.poll() is not None:
                self._standby[label] = self._popen(spec, rank)

    def _popen(self, spec: ActorLaunch, rank: int) -> subprocess.Popen:
        command = launch.command(spec.name)
        if spec.name == "worker":
            process = self._executor.popen(rank, command)
        else:
            process = subprocess.Popen(command, stdin=subprocess.PIPE, pass_fds=self._pass_fds)
        assert process.stdin is not None
        process.stdin.write(launch.frame(spec))
        process.stdin.flush()
        return process

    @staticmethod
    def _write(process: subprocess.Popen, data: bytes) -> bool:
        assert process.stdin is not None
        try:
            process.stdin.write(data)
            process.stdin.close()
            return True
        except BrokenPipeError:
            return False

    def exit_code(self, label: str) -> int | None:
        return self.running[label].poll()

    def kill(self, labels: list[str]) -> None:
        """SIGKILL and reap (a hung actor, or the rest of a worker group)."""
        for label in labels:
            process = self.running.get(label)
            if process is not None and process.poll() is None:
                process.kill()  # SIGKILL (a Ray worker's: on its node)
        for label in labels:
            process = self.running.get(label)
            if process is not None:
                process.wait()

    def stop_all(self) -> None:
        """SIGTERM every actor, wait, SIGKILL what is left; standbys end on EOF."""
        spares = list(self._standby.values())
        for process in spares:
            if process.stdin is not None and not process.stdin.closed:
                try:
                    process.stdin.close()
                except BrokenPipeError:
                    pass  # the standby is gone already
        processes = [*self.running.values(), *spares]
        for process in processes:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
