"""Actor base: one process, one anyio loop, one inbox; ready handshake; heartbeat; clean stop.

Life of an actor process (started by the supervisor, see launch.py):
  build the actor from its `ActorLaunch` -> `prepare()` (load what needs no socket and no
  device: a standby process does this ahead of need) -> `ActorStart` (its rank and epoch) ->
  `run_actor_process`: `setup()` (bind sockets, load the rest) -> tell the supervisor
  `ActorReady` -> heartbeats start -> `run()` until SIGTERM, a `Shutdown` message or the
  parent's death -> `close()`.
SIGINT is ignored in actors: Ctrl-C reaches the whole process group, and the parent (which owns
the supervisor) decides how everyone stops. The process title is `pagedserve:<label>`.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from typing import ClassVar

import anyio
import msgspec
import setproctitle
import zmq

from pagedserve.actors import bus, network
from pagedserve.actors.gc_pauses import GcPauses
from pagedserve.actors.heartbeat import HeartbeatThread, Liveness, StatsProbe
from pagedserve.actors.messages import ActorFailed, ActorReady
from pagedserve.actors.security import Credentials
from pagedserve.config import EngineConfig

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5


class ActorLaunch(msgspec.Struct, kw_only=True):
    """What the supervisor writes to a new actor's standard input first."""

    name: str
    run_dir: str
    config: EngineConfig
    credentials: Credentials | None = None  # the run's keys (with the server's secret)
    listen_fd: int = -1  # the API server's listening socket, bound once by the supervisor


class ActorStart(msgspec.Struct, kw_only=True):
    """What the supervisor writes next, when the actor must start (at once, or when a
    standby process is taken into service)."""

    rank: int
    epoch: int  # the supervisor's restart count when it started this actor


def process_title(label: str) -> str:
    return f"pagedserve:{label}"


class Actor:
    name: ClassVar[str] = "actor"

    def __init__(self, launch: ActorLaunch) -> None:
        self.config = launch.config
        self.addresses = network.engine_addresses(launch.run_dir, launch.config.network)
        self.rank = 0  # rank and epoch: from ActorStart
        self.epoch = 0
        self.credentials = launch.credentials
        self.listen_fd = launch.listen_fd
        self.ctx = bus.async_context(launch.credentials)
        self.sync_ctx = bus.sync_context(
            launch.credentials.for_clients() if launch.credentials else None
        )
        self.liveness = Liveness()
        self.probe = StatsProbe()
        self.gc_pauses = GcPauses()
        self._heartbeat: HeartbeatThread | None = None

    def prepare(self) -> None:
        """Load what needs no socket, no device and no rank (a tokenizer), ahead of need."""

    @property
    def label(self) -> str:
        return self.name if self.rank == 0 else f"{self.name}-{self.rank}"

    @property
    def title(self) -> str:
        """The process title (`ps`, `top`, `pgrep`)."""
        return process_title(self.label)

    async def setup(self) -> dict:
        """Bind/connect sockets and load state. Returns extra fields for ActorReady."""
        return {}

    async def run(self) -> None:
        """The receive -> dispatch -> act -> send loop."""
        raise NotImplementedError

    def queue_depths(self) -> dict[str, int]:
        """The actor's own queues, for heartbeats (read from the heartbeat thread: sizes
        only)."""
        return {}

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
        self.ctx.destroy(linger=0)
        self.sync_ctx.destroy(linger=0)

    async def serve(self) -> None:
        ready_fields = await self.setup()
        self.gc_pauses.freeze_start_up_heap()
        self.gc_pauses.install()
        self._tell_supervisor(ActorReady(name=self.label, pid=os.getpid(), **ready_fields))
        self._heartbeat = HeartbeatThread(
            self.sync_ctx,
            self.addresses.supervisor,
            self.config.supervision.heartbeat_interval_s,
            self.stats,
        )
        self._heartbeat.start()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_exit_with_parent, tg.cancel_scope, os.getppid())
            tg.start_soon(_exit_on_sigterm, tg.cancel_scope)
            tg.start_soon(self.liveness.tick_forever)
            await self.run()
            tg.cancel_scope.cancel()

    def stats(self):  # -> ActorStats, from the heartbeat thread
        traffic = bus.traffic_of(self.ctx)
        return self.probe.stats(
            self.label, self.epoch, traffic, self.liveness, self.queue_depths(),
            self.gc_pauses.stats(),
        )  # fmt: skip

    def _tell_supervisor(self, message: ActorReady | ActorFailed) -> None:
        sock = bus.push_socket(self.sync_ctx, self.addresses.supervisor)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.send(bus.encode(message))
        sock.close()

    def report_failure(self, error: str) -> None:
        try:
            self._tell_supervisor(ActorFailed(self.label, error, pid=os.getpid()))
        except zmq.ZMQError:
            pass


async def _exit_with_parent(scope: anyio.CancelScope, parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        await anyio.sleep(PARENT_POLL_S)
    logger.warning("parent process %d died; stopping", parent_pid)
    scope.cancel()


async def _exit_on_sigterm(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            scope.cancel()
            return


def run_actor_process(actor: Actor, start: ActorStart) -> None:
    """Run a prepared actor (see launch.py) until it stops."""
    actor.rank, actor.epoch = start.rank, start.epoch
    logging.basicConfig(
        level=actor.config.log_level,
        format=f"%(asctime)s {actor.name}[{actor.rank}] %(levelname)s %(name)s: %(message)s",
    )
    setproctitle.setproctitle(actor.title)
    try:
        anyio.run(actor.serve, backend="asyncio", backend_options={"use_uvloop": _has_uvloop()})
    except Exception:
        logger.exception("%s crashed", actor.label)
        actor.report_failure(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        actor.close()


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401

        return True
    except ImportError:
        return False
