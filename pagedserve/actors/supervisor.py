"""Starts the actor topology, watches it, and tears it down without leaving anything behind.

Start order: the workers (they load the model and report how many KV blocks fit) together
with the tokenizer and any extra actor (the HTTP server), then the scheduler, sized by the
smallest worker's report. Every actor says
`ActorReady` once its sockets are bound. `stop()` sends SIGTERM, waits, kills stragglers and
removes the private run directory with its socket files. A watcher thread restarts the actors
that hold no engine state (tokenizer, HTTP server) when they die; the death of any other actor
marks the engine dead, so clients fail fast instead of hanging.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
import threading
import time

import msgspec
import zmq

from pagedserve.actors import bus, launch
from pagedserve.actors.messages import ActorFailed, ActorReady, SupervisorInbound
from pagedserve.config import EngineConfig, encode_config

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0
RESTARTABLE = ("tokenizer", "api-server")  # hold no engine state: a new one picks up the work
MAX_RESTARTS = 3
STOP_TIMEOUT_S = 10.0


class EngineDeadError(RuntimeError):
    pass


class Supervisor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config.resolve()
        self.run_dir = tempfile.mkdtemp(prefix="pagedserve-", dir=config.run_dir)
        self.addresses = bus.Addresses(self.run_dir)
        self.processes: dict[str, subprocess.Popen] = {}
        self.num_kv_blocks = 0
        self.dead_reason: str | None = None
        self._ctx = zmq.Context()
        self._inbox = bus.pull_socket(self._ctx, self.addresses.supervisor)
        self._codec: bus.Codec[ActorReady | ActorFailed] = bus.Codec(
            SupervisorInbound, "supervisor"
        )
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.restarts: dict[str, int] = {}
        self._readies: dict[str, ActorReady] = {}
        self._spawned_at: dict[str, float] = {}
        # per actor: seconds from its spawn to ActorReady, and its own setup phases
        self.startup_seconds: dict[str, dict[str, float]] = {}
        self.sized_config = self.config
        self._watcher: threading.Thread | None = None

    def start(self, extra_actors: tuple[str, ...] = ()) -> None:
        """Start the engine; `extra_actors` names more actors (see launch.ACTORS), e.g. the
        HTTP server. The actors that need no KV-cache size start with the workers."""
        try:
            workers = [
                self._spawn("worker", self.config, r)
                for r in range(self.config.tensor_parallel_size)
            ]
            others = [self._spawn(name, self.config, 0) for name in ("tokenizer", *extra_actors)]
            readies = self._wait_ready(set(workers))
            self.num_kv_blocks = min(readies[label].num_kv_blocks for label in workers)
            sized = msgspec.structs.replace(self.config, num_kv_blocks=self.num_kv_blocks)
            self.sized_config = sized
            self._wait_ready({self._spawn("scheduler", sized, 0), *others})
        except BaseException:
            self.stop()
            raise
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="supervisor-watch")
        self._watcher.start()

    def _spawn(self, name: str, config: EngineConfig, rank: int) -> str:
        label = name if rank == 0 else f"{name}-{rank}"
        process = subprocess.Popen(launch.command(name, rank, self.run_dir), stdin=subprocess.PIPE)
        assert process.stdin is not None
        process.stdin.write(encode_config(config))
        process.stdin.close()
        self.processes[label] = process
        self._spawned_at[label] = time.monotonic()
        return label

    def _wait_ready(self, labels: set[str]) -> dict[str, ActorReady]:
        """Wait until every actor in `labels` is ready (others' reports are kept too)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not labels <= self._readies.keys():
            if time.monotonic() > deadline:
                raise TimeoutError("actors did not become ready in time")
            self._raise_if_any_died()
            if not self._inbox.poll(200):
                continue
            message = self._codec.decode(self._inbox.recv())
            if isinstance(message, ActorFailed):
                raise EngineDeadError(f"{message.name} failed to start:\n{message.error}")
            if isinstance(message, ActorReady):
                self._on_ready(message)
        return self._readies

    def _on_ready(self, message: ActorReady) -> None:
        since_spawn = time.monotonic() - self._spawned_at.get(message.name, time.monotonic())
        timings = {"ready": round(since_spawn, 3)} | message.setup_s
        self.startup_seconds[message.name] = timings
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in timings.items())
        logger.info("%s ready (pid %d): %s", message.name, message.pid, phases)
        self._readies[message.name] = message

    def _raise_if_any_died(self) -> None:
        for label, process in self.processes.items():
            if process.poll() is not None:
                raise EngineDeadError(f"{label} exited with code {process.returncode}")

    def _watch(self) -> None:
        """Restart a dead stateless actor (tokenizer, HTTP server); any other death, or too
        many restarts, marks the engine dead."""
        while not self._stopping.wait(0.5):
            for label, process in list(self.processes.items()):
                if process.poll() is None:
                    continue
                reason = f"{label} died with exit code {process.returncode}"
                if label not in RESTARTABLE or self.restarts.get(label, 0) >= MAX_RESTARTS:
                    self._mark_dead(reason)
                    return
                logger.error("%s; restarting it", reason)
                self.restarts[label] = self.restarts.get(label, 0) + 1
                with self._lock:
                    if self._stopping.is_set():
                        return
                    self._spawn(label, self.sized_config, 0)

    def _mark_dead(self, reason: str) -> None:
        logger.error("engine is dead: %s", reason)
        self.dead_reason = reason

    def stop(self) -> None:
        """SIGTERM every actor, wait, kill what is left, remove the run directory."""
        with self._lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in self.processes.values():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._inbox.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self.run_dir, ignore_errors=True)
