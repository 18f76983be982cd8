"""Where the supervisor starts worker processes (config.distributed_executor_backend).

"mp" (the default): child processes of the supervisor on this machine. "ray": processes on the
nodes of an existing Ray cluster, one per placement-group bundle (actors/ray_executor.py; Ray
is imported only then). Either way a worker is the same `python -m pagedserve.actors.launch`
process reading its ActorLaunch and ActorStart frames on standard input (launch.py), and
ActorProcesses holds a `subprocess.Popen` or an object with the same methods (poll, wait,
terminate, kill, pid, returncode, stdin).
"""

from __future__ import annotations

import subprocess
from typing import Protocol

from pagedserve.config import EngineConfig, NetworkConfig


class WorkerExecutor(Protocol):
    network: NetworkConfig | None  # the engine's tcp wiring (None: ipc on this machine)

    def popen(self, rank: int, command: list[str]) -> subprocess.Popen:
        """Start worker `rank`'s process (`command`, standard input a pipe)."""

    def shutdown(self) -> None:
        """Release what the executor holds (its processes are already stopped)."""


class LocalExecutor:
    network: NetworkConfig | None = None

    def popen(self, rank: int, command: list[str]) -> subprocess.Popen:
        return subprocess.Popen(command, stdin=subprocess.PIPE)

    def shutdown(self) -> None:
        pass


def worker_executor(config: EngineConfig) -> WorkerExecutor:
    """The executor config.distributed_executor_backend names; ValueError when Ray is asked
    for and cannot be used (not installed, no cluster, not enough resources)."""
    if config.distributed_executor_backend == "ray":
        try:
            from pagedserve.actors.ray_executor import RayExecutor
        except ImportError as exc:
            if exc.name is None or exc.name.split(".")[0] != "ray":
                raise
            raise ValueError(
                "distributed_executor_backend='ray' needs Ray: pip install 'pagedserve[ray]'"
            ) from None
        return RayExecutor(config)
    return LocalExecutor()
