"""Run one actor alone, started as the supervisor starts it; the profiler plays its peers.

`SoloActor(name, config)` makes a private run directory and the run's credentials, starts the
actor process (`python -m pagedserve.actors.launch NAME`, its launch on standard input) and
waits for its ActorReady. The profiler binds or connects the peer sockets it needs with
`peer_context()`, which holds the same credentials (server and client keys).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time

import msgspec
import zmq

from pagedserve.actors import bus
from pagedserve.actors.actor import ActorLaunch
from pagedserve.actors.addresses import Addresses
from pagedserve.actors.executors import LocalExecutor
from pagedserve.actors.processes import ActorProcesses
from pagedserve.actors.security import Credentials
from pagedserve.actors.supervision_messages import ActorFailed, ActorReady, SupervisorInbound
from pagedserve.config import EngineConfig

READY_TIMEOUT_S = 300.0


class SoloActor:
    def __init__(self, name: str, config: EngineConfig, listen_fd: int = -1) -> None:
        self.config = config.resolve()
        self.run_dir = tempfile.mkdtemp(prefix=f"profile-{name}-")
        self.addresses = Addresses(self.run_dir)
        self.credentials = Credentials.generate()
        self.sync_ctx = bus.sync_context(self.credentials)
        self._inbox = bus.pull_socket(self.sync_ctx, self.addresses.supervisor)
        self._processes = ActorProcesses(
            LocalExecutor(), pass_fds=(listen_fd,) if listen_fd >= 0 else ()
        )
        launch = ActorLaunch(
            name=name, run_dir=self.run_dir, config=self.config,
            credentials=self.credentials, listen_fd=listen_fd,
        )  # fmt: skip
        self._processes.spawn(launch, rank=0, epoch=0)
        self.ready = self._wait_ready()

    def _wait_ready(self) -> ActorReady:
        codec: bus.Codec = bus.Codec(SupervisorInbound, "profile")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._inbox.poll(200):
                message = codec.decode(self._inbox.recv())
                if isinstance(message, ActorReady):
                    return message
                if isinstance(message, ActorFailed):
                    raise RuntimeError(message.error)
        raise TimeoutError("the actor did not become ready")

    def peer_context(self) -> bus.EngineContext:
        """An asyncio context for the profiler's peer sockets (server and client keys)."""
        return bus.async_context(self.credentials)

    def close(self) -> None:
        self._processes.stop_all()
        self._inbox.close(linger=0)
        self.sync_ctx.destroy(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def percentiles(samples: list[float]) -> dict[str, float]:
    """p50 / p90 / p99 of `samples` (seconds) in microseconds."""
    ordered = sorted(samples)
    return {
        "p50_us": statistics.median(ordered) * 1e6,
        "p90_us": ordered[int(0.9 * (len(ordered) - 1))] * 1e6,
        "p99_us": ordered[int(0.99 * (len(ordered) - 1))] * 1e6,
    }


def dealer(ctx: zmq.Context, address: str, name: str) -> zmq.Socket:
    return bus.dealer_socket(ctx, address, f"{name}-{time.monotonic_ns()}".encode())


def latency_cells(result: dict[str, float]) -> list[str]:
    return [f"{result[k]:.0f}" for k in ("p50_us", "p90_us", "p99_us")]


def row(values: list[object]) -> str:
    return "| " + " | ".join(str(v) for v in values) + " |"


def encode(message: msgspec.Struct) -> bytes:
    return bus.encode(message)
