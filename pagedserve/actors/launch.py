"""Entry point of every actor process:

    python -m pagedserve.actors.launch NAME   < ActorLaunch, then ActorStart (framed msgpack)

Actors start as fresh interpreters rather than through multiprocessing, so a user's script is
never re-imported in them (no `if __name__ == "__main__"` needed) and nothing is pickled. The
launch (configuration, credentials: never in argv or the environment) comes on standard input
in two frames. After the first, the process imports its actor's module and prepares it (loads
a tokenizer...); after the second (its rank and epoch) it starts. So the supervisor can keep a
*standby* process prepared ahead of need and start it when an actor must be restarted, which
then skips the imports and the preparation. A standby whose standard input closes exits.
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()  # before the imports: an actor reports their time

import importlib  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import struct  # noqa: E402
import sys  # noqa: E402
from typing import BinaryIO  # noqa: E402

import msgspec  # noqa: E402
import setproctitle  # noqa: E402

from pagedserve.actors.actor import (  # noqa: E402
    Actor,
    ActorLaunch,
    ActorStart,
    process_title,
    run_actor_process,
)

ACTORS = {
    "worker": ("pagedserve.actors.worker.actor", "WorkerActor"),
    "scheduler": ("pagedserve.actors.scheduler.actor", "SchedulerActor"),
    "tokenizer": ("pagedserve.actors.tokenizer", "TokenizerActor"),
    "detokenizer": ("pagedserve.actors.detokenizer", "DetokenizerActor"),
    "api-server": ("pagedserve.api.openai_server", "APIServerActor"),
}
_LENGTH = struct.Struct("<I")


def actor_class(name: str) -> type[Actor]:
    module, attribute = ACTORS[name]
    return getattr(importlib.import_module(module), attribute)


def command(name: str) -> list[str]:
    return [sys.executable, "-m", "pagedserve.actors.launch", name]


def frame(message: ActorLaunch | ActorStart) -> bytes:
    data = msgspec.msgpack.encode(message)
    return _LENGTH.pack(len(data)) + data


def _read_frame(stream: BinaryIO) -> bytes | None:
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        return None  # the supervisor closed the pipe: not needed
    (size,) = _LENGTH.unpack(header)
    return stream.read(size)


def main() -> None:
    global PROCESS_START
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides how everyone stops
    stdin = sys.stdin.buffer
    name = sys.argv[1]
    setproctitle.setproctitle(process_title(f"standby-{name}"))
    launch = _read_frame(stdin)
    if launch is None:
        return
    actor = actor_class(name)(msgspec.msgpack.decode(launch, type=ActorLaunch))
    actor.prepare()
    prepared_s = time.perf_counter() - PROCESS_START
    start = _read_frame(stdin)
    if start is None:
        return
    PROCESS_START = time.perf_counter() - prepared_s  # the worker reports its imports' time
    run_actor_process(actor, msgspec.msgpack.decode(start, type=ActorStart))


def exit_now() -> None:
    """Exit without the interpreter's teardown, which after torch's and transformers' imports
    takes seconds of CPU: the actor has closed its sockets and written its files."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    exit_now()
