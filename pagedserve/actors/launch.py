"""Entry point of every actor process:

    python -m pagedserve.actors.launch NAME RANK RUN_DIR EPOCH   < encoded EngineConfig

Actors start as fresh interpreters rather than through multiprocessing, so a user's script is
never re-imported in them (no `if __name__ == "__main__"` needed) and nothing is pickled.
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()  # before the imports: an actor reports their time

import importlib  # noqa: E402
import sys  # noqa: E402

from pagedserve.actors.actor import Actor, run_actor_process  # noqa: E402

ACTORS = {
    "worker": ("pagedserve.actors.worker.actor", "WorkerActor"),
    "scheduler": ("pagedserve.actors.scheduler.actor", "SchedulerActor"),
    "tokenizer": ("pagedserve.actors.tokenizer", "TokenizerActor"),
    "detokenizer": ("pagedserve.actors.detokenizer", "DetokenizerActor"),
    "api-server": ("pagedserve.api.openai_server", "APIServerActor"),
}


def actor_class(name: str) -> type[Actor]:
    module, attribute = ACTORS[name]
    return getattr(importlib.import_module(module), attribute)


def command(name: str, rank: int, run_dir: str, epoch: int) -> list[str]:
    return [sys.executable, "-m", "pagedserve.actors.launch", name, str(rank), run_dir, str(epoch)]


def main() -> None:
    name, rank, run_dir, epoch = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    config_bytes = sys.stdin.buffer.read()
    run_actor_process(actor_class(name), config_bytes, run_dir, rank, epoch)


if __name__ == "__main__":
    main()
