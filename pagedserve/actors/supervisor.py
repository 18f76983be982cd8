"""Starts the actor topology, watches it, and tears it down without leaving anything behind.

Start order: the workers (they load the model and report how many KV blocks fit; one per rank
of the TP x PP grid, started by the executor: here, or on the nodes of a Ray cluster) together
with the tokenizer, the detokenizer and any extra actor (the HTTP server), then the scheduler,
sized by the smallest worker's report. Every actor says `ActorReady` once its sockets are bound.
`stop()` sends SIGTERM, waits, kills stragglers and removes the private run directory with its
socket files.

A watcher thread restarts the actors that own no request state (tokenizer, detokenizer, HTTP
server) when they die, within a restart budget per actor (RESTART_BUDGET restarts a
RESTART_WINDOW_S: a rate, not a lifetime count). Each restart moves the engine's *epoch*: the
restarted actor starts with it, and the detokenizer hands it to clients, which then resubmit
what they still wait for (api/client_core.py). The death of any other actor, or a budget
spent, marks the engine dead, so clients fail fast instead of hanging.
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

from pagedserve.actors import bus, launch, network
from pagedserve.actors.executors import worker_executor
from pagedserve.actors.messages import ActorFailed, ActorReady, EpochChanged, SupervisorInbound
from pagedserve.config import EngineConfig, encode_config

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0
RESTART_READY_TIMEOUT_S = 120.0
# own no request state: a new one picks up the work
RESTARTABLE = ("tokenizer", "detokenizer", "api-server")
RESTART_BUDGET = 5  # restarts of one actor ...
RESTART_WINDOW_S = 60.0  # ... within this many seconds
WATCH_INTERVAL_S = 0.1
STOP_TIMEOUT_S = 10.0


class EngineDeadError(RuntimeError):
    pass


class Supervisor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config.resolve()
        self.executor = worker_executor(self.config)  # before any file or process is made
        self.config = msgspec.structs.replace(self.config, network=self.executor.network)
        self.run_dir = tempfile.mkdtemp(prefix="pagedserve-", dir=config.run_dir)
        self.addresses = network.engine_addresses(self.run_dir, self.config.network)
        self.processes: dict[str, subprocess.Popen] = {}
        self.num_kv_blocks = 0
        self.dead_reason: str | None = None
        self._ctx = zmq.Context()
        try:
            self._inbox = bus.pull_socket(self._ctx, self.addresses.supervisor)
        except zmq.ZMQError:
            self._ctx.term()
            self.executor.shutdown()
            shutil.rmtree(self.run_dir, ignore_errors=True)
            raise
        self._codec: bus.Codec[ActorReady | ActorFailed] = bus.Codec(
            SupervisorInbound, "supervisor"
        )
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.epoch = 0  # restarts so far
        self.restarts: dict[str, list[float]] = {}  # per actor: monotonic times of restarts
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
            workers = [self._spawn("worker", self.config, r) for r in range(self.config.world_size)]
            front = ("tokenizer", "detokenizer", *extra_actors)
            others = [self._spawn(name, self.config, 0) for name in front]
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
        command = launch.command(name, rank, self.run_dir, self.epoch)
        if name == "worker":
            process = self.executor.popen(rank, command)
        else:
            process = subprocess.Popen(command, stdin=subprocess.PIPE)
        assert process.stdin is not None
        process.stdin.write(encode_config(config))
        process.stdin.close()
        self.processes[label] = process
        self._spawned_at[label] = time.monotonic()
        return label

    def _wait_ready(
        self, labels: set[str], timeout_s: float = READY_TIMEOUT_S, only_these: bool = False
    ) -> dict[str, ActorReady]:
        """Wait until every actor in `labels` is ready (others' reports are kept too). At
        start-up any death fails the wait; with `only_these`, only those of `labels`."""
        deadline = time.monotonic() + timeout_s
        watched = labels if only_these else set(self.processes)
        while not labels <= self._readies.keys():
            if time.monotonic() > deadline:
                raise TimeoutError("actors did not become ready in time")
            self._raise_if_any_died(watched)
            if not self._inbox.poll(200):
                continue
            message = self._codec.decode(self._inbox.recv())
            if isinstance(message, ActorFailed) and message.name in watched:
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

    def _raise_if_any_died(self, labels: set[str]) -> None:
        for label, process in self.processes.items():
            if label in labels and process.poll() is not None:
                raise EngineDeadError(f"{label} exited with code {process.returncode}")

    def _watch(self) -> None:
        """Restart a dead actor that owns no request state, within its budget; any other
        death, or a spent budget, marks the engine dead."""
        while not self._stopping.wait(WATCH_INTERVAL_S):
            for label, process in list(self.processes.items()):
                if process.poll() is not None and not self._stopping.is_set():
                    reason = f"{label} died with exit code {process.returncode}"
                    if not self._restart(label, reason):
                        self._mark_dead(reason)
                        return

    def _restart(self, label: str, reason: str) -> bool:
        """Start a new `label` at a new epoch and tell the clients; False if not allowed."""
        now = time.monotonic()
        recent = [t for t in self.restarts.get(label, []) if now - t < RESTART_WINDOW_S]
        if label not in RESTARTABLE or len(recent) >= RESTART_BUDGET:
            return False
        logger.error("%s; restarting it", reason)
        self.restarts[label] = [*recent, now]
        with self._lock:
            if self._stopping.is_set():
                return True
            self.epoch += 1
            self._readies.pop(label, None)
            while self._inbox.poll(0):  # the dead actor's last words (ActorFailed)
                self._inbox.recv()
            self._spawn(label, self.sized_config, 0)
        try:
            self._wait_ready({label}, RESTART_READY_TIMEOUT_S, only_these=True)
        except (TimeoutError, EngineDeadError) as exc:
            logger.error("restarting %s failed: %s", label, exc)
            return False
        self._announce_epoch()
        return True

    def _announce_epoch(self) -> None:
        """Tell the detokenizer (and through it every client) that the epoch moved."""
        sock = bus.push_socket(self._ctx, self.addresses.detokenizer_inbox)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.send(bus.encode(EpochChanged(self.epoch)))
        sock.close()

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
        self.executor.shutdown()
        shutil.rmtree(self.run_dir, ignore_errors=True)
