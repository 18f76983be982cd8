"""Actor base: one process, one anyio loop, one inbox; ready handshake; clean stop.

Life of an actor process (started by the supervisor with the `spawn` method):
  `run_actor_process` -> build the actor -> `setup()` (bind sockets, load what it needs)
  -> tell the supervisor `ActorReady` -> `run()` until SIGTERM, a `Shutdown` message or the
  parent's death -> `close()`.
SIGINT is ignored in actors: Ctrl-C reaches the whole process group, and the parent (which owns
the supervisor) decides how everyone stops.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from typing import ClassVar

import anyio
import zmq
import zmq.asyncio

from pagedserve.actors import bus, network
from pagedserve.actors.messages import ActorFailed, ActorReady
from pagedserve.config import EngineConfig, decode_config

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5


class Actor:
    name: ClassVar[str] = "actor"

    def __init__(
        self, config: EngineConfig, addresses: bus.Addresses, rank: int = 0, epoch: int = 0
    ) -> None:
        self.config = config
        self.addresses = addresses
        self.rank = rank
        self.epoch = epoch  # the supervisor's restart count when it started this actor
        self.ctx = zmq.asyncio.Context()

    @property
    def label(self) -> str:
        return self.name if self.rank == 0 else f"{self.name}-{self.rank}"

    async def setup(self) -> dict:
        """Bind/connect sockets and load state. Returns extra fields for ActorReady."""
        return {}

    async def run(self) -> None:
        """The receive -> dispatch -> act -> send loop."""
        raise NotImplementedError

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    async def serve(self) -> None:
        ready_fields = await self.setup()
        self._tell_supervisor(ActorReady(name=self.label, pid=os.getpid(), **ready_fields))
        async with anyio.create_task_group() as tg:
            tg.start_soon(_exit_with_parent, tg.cancel_scope, os.getppid())
            tg.start_soon(_exit_on_sigterm, tg.cancel_scope)
            await self.run()
            tg.cancel_scope.cancel()

    def _tell_supervisor(self, message: ActorReady | ActorFailed) -> None:
        ctx = zmq.Context.instance()
        sock = bus.push_socket(ctx, self.addresses.supervisor)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.send(bus.encode(message))
        sock.close()

    def report_failure(self, error: str) -> None:
        try:
            self._tell_supervisor(ActorFailed(self.label, error))
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


def run_actor_process(
    actor_cls: type[Actor], config_bytes: bytes, run_dir: str, rank: int, epoch: int
) -> None:
    """Entry point of every actor process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = decode_config(config_bytes)
    addresses = network.engine_addresses(run_dir, config.network)
    logging.basicConfig(
        level=config.log_level,
        format=f"%(asctime)s {actor_cls.name}[{rank}] %(levelname)s %(name)s: %(message)s",
    )
    actor = actor_cls(config, addresses, rank, epoch)
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
