"""Starts the actor topology, watches it, restarts what fails, and tears it down.

Start order: the workers (they load the model and report how many KV blocks fit; one per rank
of the TP x PP grid, started by the executor: here, or on the nodes of a Ray cluster) together
with the tokenizer, the detokenizer and any extra actor (the HTTP server), then the scheduler,
sized by the smallest worker's report. Every actor says `ActorReady` once its sockets are bound,
then sends a heartbeat every interval. `stop()` sends SIGTERM, waits, kills stragglers and
removes the private run directory with its socket files and credentials.

A watcher thread restarts any actor that dies or hangs (watchdog.py), each restart at a new
*epoch*:
- a worker (any rank; the whole TP x PP group restarts together): the scheduler hears
  `WorkersLost` at once (it takes every running request back to waiting, to be recomputed, and
  ignores the lost steps' results) and `WorkersReady` when the new group is up (its next plan
  resets them);
- the scheduler: its first plan resets the workers; the detokenizer forgets the old
  scheduler's handles, and clients, seeing the epoch move, resubmit what they wait for with
  the tokens they hold;
- the tokenizer, the detokenizer, the HTTP server: clients resubmit (the HTTP server's
  listening socket is bound here, once, and handed to each incarnation, so new connections
  wait in its backlog).
When an actor cannot be restarted (budget spent, or it fails to start again and again), the
engine is dead: the detokenizer ends every waiting request with a 503 and answers every later
ping with the reason.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
import time

import msgspec
import zmq

from pagedserve.actors import bus, network
from pagedserve.actors.actor import ActorLaunch
from pagedserve.actors.executors import worker_executor
from pagedserve.actors.messages import (
    EPOCH_SHIFT,
    EngineFailed,
    EpochChanged,
    WorkersLost,
    WorkersReady,
)
from pagedserve.actors.processes import ActorProcesses
from pagedserve.actors.security import CREDENTIALS_FILE, Credentials
from pagedserve.actors.supervision_messages import (
    ActorFailed,
    ActorReady,
    ActorStatus,
    EngineStatus,
    Heartbeat,
    StatusRequest,
    SupervisorInbound,
)
from pagedserve.actors.watchdog import HeartbeatMonitor, RestartBudget
from pagedserve.config import EngineConfig

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0
POLL_MS = 100
JOIN_TIMEOUT_S = 5.0


class EngineDeadError(RuntimeError):
    pass


class _Stopping(Exception):
    """The supervisor is stopping: a wait for actors ends."""


class Supervisor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config.resolve()
        self.executor = worker_executor(self.config)  # before any file or process is made
        self.config = msgspec.structs.replace(self.config, network=self.executor.network)
        self.run_dir = tempfile.mkdtemp(prefix="pagedserve-", dir=config.run_dir)
        self.addresses = network.engine_addresses(self.run_dir, self.config.network)
        self.listener: socket.socket | None = None
        try:
            self.credentials, self.credentials_path = self._make_credentials()
            self.listener = self._bind_http_listener()
            self._ctx = bus.sync_context(self.credentials)
            self._inbox = bus.pull_socket(self._ctx, self.addresses.supervisor)
            self._status = bus.router_socket(self._ctx, self.addresses.status)
        except BaseException:
            self._release()
            raise
        fds = (self.listener.fileno(),) if self.listener is not None else ()
        self._processes = ActorProcesses(self.executor, pass_fds=fds)
        self.num_kv_blocks = 0
        self.dead_reason: str | None = None
        self.epoch = 0  # restarts so far
        self.sized_config = self.config
        self.monitor = HeartbeatMonitor(self.config.supervision)
        self.budget = RestartBudget(self.config.supervision)
        self._groups: dict[str, list[str]] = {}  # actor name -> labels (workers: one a rank)
        self._readies: dict[str, ActorReady] = {}
        self._failures: dict[str, str] = {}  # label -> the error its ActorFailed carried
        self.startup_seconds: dict[str, dict[str, float]] = {}  # per actor: spawn to ready
        self._codec: bus.Codec = bus.Codec(SupervisorInbound, "supervisor")
        self._status_codec: bus.Codec = bus.Codec(StatusRequest, "status")
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    def _make_credentials(self) -> tuple[Credentials, str | None]:
        """Keys derived from the API key, or random ones with the clients' part in a file."""
        server = self.config.server
        if server is not None and server.api_key:
            return Credentials.from_api_key(server.api_key), None
        credentials = Credentials.generate()
        path = os.path.join(self.run_dir, CREDENTIALS_FILE)
        credentials.write(path)
        return credentials, path

    def _bind_http_listener(self) -> socket.socket | None:
        server = self.config.server
        if server is None:
            return None
        return socket.create_server((server.host, server.port), backlog=2048)

    @property
    def processes(self) -> dict:
        """The live process of each actor, by label (worker, worker-1, scheduler, ...)."""
        return self._processes.running

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts so far by actor name (a worker group counts as "worker")."""
        return dict(self.budget.total)

    # ------------------------------------------------------------------ start

    def start(self, extra_actors: tuple[str, ...] = ()) -> None:
        """Start the engine; `extra_actors` names more actors (see launch.ACTORS), e.g. the
        HTTP server. The actors that need no KV-cache size start with the workers."""
        try:
            workers = self._spawn_group("worker", self.config)
            others = [self._spawn("tokenizer", self.config, 0)]
            others += [self._spawn(name, self.config, 0) for name in ("detokenizer", *extra_actors)]
            readies = self._wait_ready(set(workers), READY_TIMEOUT_S, set(self.processes))
            self.num_kv_blocks = min(readies[label].num_kv_blocks for label in workers)
            self.sized_config = msgspec.structs.replace(
                self.config, num_kv_blocks=self.num_kv_blocks
            )
            scheduler = self._spawn("scheduler", self.sized_config, 0)
            self._wait_ready({scheduler, *others}, READY_TIMEOUT_S, set(self.processes))
        except BaseException:
            self.stop()
            raise
        for label in self.processes:
            self.monitor.watch(label)
        self._prepare_standbys()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="supervisor-watch")
        self._watcher.start()

    def _spawn_group(self, name: str, config: EngineConfig) -> list[str]:
        size = self.config.world_size if name == "worker" else 1
        return [self._spawn(name, config, rank) for rank in range(size)]

    def _launch(self, name: str, config: EngineConfig) -> ActorLaunch:
        # a worker binds no socket (it connects to the scheduler's plan channel), so it gets
        # the clients' keys only: the server's secret never leaves this machine (Ray)
        credentials = self.credentials.for_clients() if name == "worker" else self.credentials
        return ActorLaunch(
            name=name, run_dir=self.run_dir, config=config, credentials=credentials,
            listen_fd=self.listener.fileno() if name == "api-server" and self.listener else -1,
        )  # fmt: skip

    def _spawn(self, name: str, config: EngineConfig, rank: int) -> str:
        label = self._processes.spawn(self._launch(name, config), rank, self.epoch)
        self._groups.setdefault(name, [])
        if label not in self._groups[name]:
            self._groups[name].append(label)
        self._readies.pop(label, None)
        return label

    def _prepare_standbys(self) -> None:
        if not self.config.supervision.standby_processes:
            return
        for name, labels in self._groups.items():
            self._processes.prepare_standby(self._launch(name, self.sized_config), len(labels))

    # ------------------------------------------------------------------ messages

    def _pump(self, timeout_ms: int) -> None:
        """Handle what arrived within `timeout_ms`: reports of actors, status requests."""
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        poller.register(self._status, zmq.POLLIN)
        events = dict(poller.poll(timeout_ms))
        while self._inbox in events and self._inbox.poll(0):
            self._on_report(self._codec.decode(self._inbox.recv()))
        while self._status in events and self._status.poll(0):
            frames = self._status.recv_multipart()
            if len(frames) == 2 and self._status_codec.decode(frames[1]) is not None:
                self._status.send_multipart([frames[0], bus.encode(self.status())])

    def _on_report(self, message: object) -> None:
        if isinstance(message, Heartbeat):
            self.monitor.beat(message.stats)
        elif isinstance(message, ActorReady):
            spawned = self._processes.spawned_at.get(message.name, time.monotonic())
            timings = {"ready": round(time.monotonic() - spawned, 3)} | message.setup_s
            self.startup_seconds[message.name] = timings
            phases = ", ".join(f"{k} {v:.2f} s" for k, v in timings.items())
            logger.info("%s ready (pid %d): %s", message.name, message.pid, phases)
            self._readies[message.name] = message
        elif isinstance(message, ActorFailed) and self._runs_as(message.name, message.pid):
            self._failures[message.name] = message.error

    def _runs_as(self, label: str, pid: int) -> bool:
        """Whether process `pid` is the one running as `label`. A process killed for a restart
        may have reported its own failure first (a worker whose peer rank died: the connection
        reset), and the report may arrive once its successor has started: it is not the
        successor's failure to start."""
        process = self._processes.running.get(label)
        return process is None or process.pid == pid

    def _wait_ready(
        self, labels: set[str], timeout_s: float, watched: set[str]
    ) -> dict[str, ActorReady]:
        """Wait until every actor in `labels` is ready; the death of any actor in `watched`
        (or its failure report) fails the wait."""
        deadline = time.monotonic() + timeout_s
        while not labels <= self._readies.keys():
            if self._stopping.is_set() and self._watcher is not None:
                raise _Stopping
            if time.monotonic() > deadline:
                raise TimeoutError(f"{', '.join(sorted(labels))} did not become ready in time")
            for label in watched:
                if label in self._failures:
                    error = self._failures[label].strip()
                    logger.error("%s failed to start:\n%s", label, error)
                    raise EngineDeadError(f"{label} failed to start: {error.splitlines()[-1]}")
                code = self._processes.exit_code(label)
                if code is not None:
                    raise EngineDeadError(f"{label} exited with code {code}")
            self._pump(POLL_MS)
        return self._readies

    def status(self) -> EngineStatus:
        actors = []
        for name, labels in self._groups.items():
            for label in labels:
                alive = self._processes.exit_code(label) is None
                ready = label in self._readies
                state = "dead" if not alive else "running" if ready else "starting"
                actors.append(
                    ActorStatus(
                        label=label, state=state, restarts=self.budget.total.get(name, 0),
                        stats=self.monitor.latest.get(label),
                    )
                )  # fmt: skip
        return EngineStatus(epoch=self.epoch, dead_reason=self.dead_reason, actors=actors)

    # ------------------------------------------------------------------ watching

    def _watch(self) -> None:
        while not self._stopping.is_set():
            self._pump(POLL_MS)
            if self.dead_reason is not None or self._stopping.is_set():
                continue  # dead: the status socket still answers
            failure = self._find_failure()
            if failure is not None:
                try:
                    self._recover(*failure)
                except _Stopping:
                    return

    def _find_failure(self) -> tuple[str, str] | None:
        """(actor name, reason) of one actor that died or hung, or None."""
        for name, labels in self._groups.items():
            for label in labels:
                code = self._processes.exit_code(label)
                if code is not None:
                    return name, f"{label} died with exit code {code}"
        for label, reason in self.monitor.hung():
            name = next(n for n, labels in self._groups.items() if label in labels)
            return name, reason
        return None

    def _recover(self, name: str, reason: str) -> None:
        """Restart actor `name` (a worker: the whole group) at a new epoch, within the
        budget; give up (the engine is dead) when that is not possible."""
        labels = self._groups[name]
        for label in labels:
            self.monitor.forget(label)
        self._processes.kill(labels)
        if name == "worker":
            self._tell(self.addresses.scheduler_inbox, WorkersLost(self.epoch + 1))
        while True:
            if not self.budget.allow(name):
                self._give_up(f"{reason}; the restart budget of {name} is spent")
                return
            logger.error("%s; restarting it", reason)
            error = self._start_again(name)
            self.budget.started(name, error is None)
            if error is None:
                break
            logger.error("restarting %s failed: %s", name, error)
            reason = f"{name} could not be restarted: {error}"
            self._processes.kill(labels)
        for label in labels:
            self.monitor.watch(label)
        self._announce(name)
        if self.config.supervision.standby_processes:
            self._processes.prepare_standby(self._launch(name, self.sized_config), len(labels))

    def _start_again(self, name: str) -> str | None:
        """Start `name` at a new epoch and wait until it is ready; None, or what failed."""
        with self._lock:
            if self._stopping.is_set():
                raise _Stopping
            self.epoch += 1
            for label in self._groups[name]:
                self._failures.pop(label, None)
            config = self.sized_config
            labels = [self._spawn(name, config, rank) for rank in range(len(self._groups[name]))]
        timeout = self.config.supervision.restart_ready_timeout_s
        try:
            self._wait_ready(set(labels), timeout, set(labels))
        except (TimeoutError, EngineDeadError) as exc:
            return str(exc)
        return None

    def _announce(self, name: str) -> None:
        """Tell whoever must know that `name` is back (see the module docstring)."""
        if name == "worker":
            self._tell(self.addresses.scheduler_inbox, WorkersReady(self.epoch))
            return
        if name == "api-server":
            return  # it held no request of the engine's other clients
        below = self.epoch << EPOCH_SHIFT if name == "scheduler" else 0
        self._tell(self.addresses.detokenizer_inbox, EpochChanged(self.epoch, below))

    def _tell(self, address: str, message: msgspec.Struct) -> None:
        sock = bus.push_socket(self._ctx, address)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.send(bus.encode(message))
        sock.close()

    def _give_up(self, reason: str) -> None:
        logger.error("engine is dead: %s", reason)
        self.dead_reason = reason
        self._tell(self.addresses.detokenizer_inbox, EngineFailed(f"the engine is dead: {reason}"))

    # ------------------------------------------------------------------ stop

    def stop(self) -> None:
        """SIGTERM every actor, wait, kill what is left, remove the run directory."""
        with self._lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(JOIN_TIMEOUT_S)
        self._processes.stop_all()
        self._release()

    def _release(self) -> None:
        """Close the sockets, hand back the executor's resources, remove the run directory."""
        ctx = getattr(self, "_ctx", None)
        if ctx is not None:
            ctx.destroy(linger=0)  # closes the inbox and the status socket
        if self.listener is not None:
            self.listener.close()
        self.executor.shutdown()
        shutil.rmtree(self.run_dir, ignore_errors=True)
