"""The actor processes of one engine: start (from a standby when there is one), kill, reap.

Each actor runs `python -m pagedserve.actors.launch NAME` and gets its `ActorLaunch` on
standard input (never argv or the environment: it holds the run's keys). With standby
processes on, the supervisor keeps one process per actor kind that has done its imports and
waits for a launch; a restart hands the launch to it and starts the next standby, so the
restart skips the imports (seconds of torch or transformers).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

from pagedserve.actors import launch
from pagedserve.actors.actor import ActorLaunch, ActorStart

STOP_TIMEOUT_S = 10.0


def label_of(name: str, rank: int) -> str:
    return name if rank == 0 else f"{name}-{rank}"


class ActorProcesses:
    def __init__(self, pass_fds: tuple[int, ...] = ()) -> None:
        self.running: dict[str, subprocess.Popen] = {}  # by label
        self.spawned_at: dict[str, float] = {}
        self._standby: dict[str, list[subprocess.Popen]] = {}  # by actor name
        self._pass_fds = pass_fds

    def spawn(self, spec: ActorLaunch, rank: int, epoch: int) -> str:
        """Start actor `spec.name` of `rank`: in a prepared standby process if one is alive."""
        label = label_of(spec.name, rank)
        spares = [p for p in self._standby.get(spec.name, []) if p.poll() is None]
        self._standby[spec.name] = spares
        start = launch.frame(ActorStart(rank=rank, epoch=epoch))
        process = spares.pop() if spares else self._popen(spec)
        if not self._write(process, start):  # the standby died meanwhile: start afresh
            process = self._popen(spec)
            self._write(process, start)
        self.running[label] = process
        self.spawned_at[label] = time.monotonic()
        return label

    def prepare_standby(self, spec: ActorLaunch, count: int = 1) -> None:
        """Keep `count` prepared standby processes of actor `spec.name` (a worker group needs
        one a rank)."""
        spares = [p for p in self._standby.get(spec.name, []) if p.poll() is None]
        while len(spares) < count:
            spares.append(self._popen(spec))
        self._standby[spec.name] = spares

    def _popen(self, spec: ActorLaunch) -> subprocess.Popen:
        process = subprocess.Popen(
            launch.command(spec.name), stdin=subprocess.PIPE, pass_fds=self._pass_fds
        )
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
                os.kill(process.pid, signal.SIGKILL)
        for label in labels:
            process = self.running.get(label)
            if process is not None:
                process.wait()

    def stop_all(self) -> None:
        """SIGTERM every actor, wait, SIGKILL what is left; standbys end on EOF."""
        spares = [p for group in self._standby.values() for p in group]
        for process in spares:
            if process.stdin is not None and not process.stdin.closed:
                process.stdin.close()
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
