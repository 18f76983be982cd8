"""The Ray executor (distributed_executor_backend="ray"): workers on the nodes of a Ray cluster.

The engine joins an existing cluster (the driver's own `ray.init(...)` when it made one, else
`ray.init(address="auto")`: RAY_ADDRESS, or the cluster this machine belongs to, started with
`ray start --head` / `ray start --address HEAD:6379`); it never starts one. A placement group
reserves one bundle per worker (a GPU each on CUDA, a CPU each on the CPU), packed on as few
nodes as possible; ranks follow the bundles ordered by node, this machine's first, so the ranks
of a tensor-parallel group (consecutive: layout.py) share a node where they fit.

Each bundle holds a `WorkerHost`, a small Ray actor that runs the worker processes of its rank
on its node (`python -m pagedserve.actors.launch worker`, the node's own interpreter, its
ActorLaunch and ActorStart frames written to its standard input as on one machine: the
running worker and its standby) and reports their exits; Ray gives the host the bundle's GPU
(CUDA_VISIBLE_DEVICES), which the process inherits, and the process ends with its host. The
supervisor holds each worker as a `RayProcess`, which has subprocess.Popen's methods, so it
watches, restarts and stops workers on other machines as it does local ones.

The workers reach the engine over tcp on this machine (network.py: the bus's bound sockets and
the torch.distributed rendezvous store that the executor hosts here). Only bytes and strings
cross Ray: the command, and the frames the worker reads from its standard input (its launch
holds the run's client keys only, never the server's secret: a worker binds no socket).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagedserve.actors import network
from pagedserve.config import EngineConfig

PLACEMENT_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 5.0


class WorkerHost:
    """The Ray actor of one bundle: starts, feeds, signals and waits for worker processes."""

    def __init__(self) -> None:
        self.processes: dict[int, subprocess.Popen] = {}

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def start(self, args: list[str]) -> int:
        process = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE)
        self.processes[process.pid] = process
        return process.pid

    def write(self, pid: int, data: bytes, close: bool) -> bool:
        """Write `data` to the process's standard input (then close it); False: it is gone."""
        stdin = self.processes[pid].stdin
        assert stdin is not None
        try:
            stdin.write(data)
            stdin.flush()
            if close:
                stdin.close()
        except (BrokenPipeError, ValueError):
            return False
        return True

    def wait(self, pid: int) -> int:
        code = self.processes[pid].wait()
        del self.processes[pid]
        return code

    def send_signal(self, pid: int, signum: int) -> None:
        process = self.processes.get(pid)
        if process is not None and process.poll() is None:
            process.send_signal(signum)


class _RemoteStdin:
    """A RayProcess's standard input (what the supervisor writes its launch to)."""

    def __init__(self, host: ray.actor.ActorHandle, pid: int) -> None:
        self.host, self.pid, self.closed = host, pid, False
        self._pending = b""

    def write(self, data: bytes) -> int:
        self._pending += data
        return len(data)

    def flush(self) -> None:
        self._send(close=False)

    def close(self) -> None:
        if not self.closed:
            self._send(close=True)
            self.closed = True

    def _send(self, close: bool) -> None:
        data, self._pending = self._pending, b""
        try:
            written = ray.get(self.host.write.remote(self.pid, data, close), timeout=CALL_TIMEOUT_S)
        except RayError:  # the host is gone (its node with it)
            written = False
        if not written:
            raise BrokenPipeError(f"worker process {self.pid} is gone")


class RayProcess:
    """A worker process on a Ray node, with subprocess.Popen's methods. A host (or node) that
    is lost counts as the process killed. `pid` is the process's id on its own node."""

    def __init__(self, host: ray.actor.ActorHandle, command: list[str]) -> None:
        self.host, self.args = host, command
        self.pid: int = ray.get(host.start.remote(command[1:]), timeout=CALL_TIMEOUT_S)
        self.stdin = _RemoteStdin(host, self.pid)
        self.returncode: int | None = None
        self._exit = host.wait.remote(self.pid)

    def poll(self) -> int | None:
        if self.returncode is None and ray.wait([self._exit], timeout=0)[0]:
            self.returncode = self._exit_code()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not ray.wait([self._exit], timeout=timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.returncode = self._exit_code()
        return self.returncode

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _exit_code(self) -> int:
        try:
            return ray.get(self._exit)
        except RayError:  # the host died (its node is gone): so did the process
            return -signal.SIGKILL

    def _signal(self, signum: int) -> None:
        try:
            ray.get(self.host.send_signal.remote(self.pid, signum), timeout=CALL_TIMEOUT_S)
        except RayError:
            pass  # the host is gone, and the process with it


class RayExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.connected_here = _connect()
        self.world_size = config.world_size
        self.on_gpu = config.device == "cuda"
        self.placement: PlacementGroup | None = None
        self.hosts: list[ray.actor.ActorHandle] = []
        self.rendezvous: network.RendezvousServer | None = None
        try:
            self.placement = self._place()
            self.hosts = [self._host(bundle) for bundle in self._bundles_by_node()]
            ray.get([h.node_ip.remote() for h in self.hosts], timeout=CALL_TIMEOUT_S)
            self.network = network.plan_network(ray.util.get_node_ip_address(), self.world_size)
            self.rendezvous = network.RendezvousServer(self.network)
        except BaseException:
            self.shutdown()
            raise

    def _place(self) -> PlacementGroup:
        resource = "GPU" if self.on_gpu else "CPU"
        available = ray.cluster_resources().get(resource, 0)
        if available < self.world_size:
            raise ValueError(
                f"the layout needs {self.world_size} workers with one {resource} each; the Ray "
                f"cluster has {available:g} {resource}s"
            )
        group = placement_group([{resource: 1}] * self.world_size, strategy="PACK")
        try:
            ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            remove_placement_group(group)
            raise ValueError(
                f"the Ray cluster could not place {self.world_size} workers with one {resource} "
                f"each within {PLACEMENT_TIMEOUT_S:g} s (its free resources: "
                f"{ray.available_resources()})"
            ) from None
        return group

    def _bundles_by_node(self) -> list[int]:
        """Bundle indices in rank order: this machine's first, then node by node."""
        assert self.placement is not None
        nodes = placement_group_table(self.placement)["bundles_to_node_id"]
        here = ray.get_runtime_context().get_node_id()
        return sorted(nodes, key=lambda b: (nodes[b] != here, nodes[b], b))

    def _host(self, bundle: int) -> ray.actor.ActorHandle:
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.placement, placement_group_bundle_index=bundle
        )
        return (
            ray.remote(WorkerHost)
            .options(
                num_cpus=0 if self.on_gpu else 1,
                num_gpus=1 if self.on_gpu else 0,
                # wait() blocks for the running process and for its standby while the
                # supervisor writes or signals
                max_concurrency=8,
                scheduling_strategy=strategy,
            )
            .remote()
        )

    def popen(self, rank: int, command: list[str]) -> RayProcess:
        return RayProcess(self.hosts[rank], command)

    def shutdown(self) -> None:
        for host in self.hosts:
            ray.kill(host)
        self.hosts = []
        if self.placement is not None:
            remove_placement_group(self.placement)
            self.placement = None
        if self.rendezvous is not None:
            self.rendezvous.close()
            self.rendezvous = None
        if self.connected_here:
            ray.shutdown()
            self.connected_here = False


def _connect() -> bool:
    """Join the driver's Ray cluster, or the one RAY_ADDRESS or this machine names; True when
    this call connected (the executor disconnects at shutdown)."""
    if ray.is_initialized():
        return False
    try:
        _check_reachable(os.environ.get("RAY_ADDRESS", ""))
        ray.init(address="auto")
    except ConnectionError as exc:
        raise ValueError(
            "distributed_executor_backend='ray' found no Ray cluster to join: start one "
            "(`ray start --head` here, `ray start --address HEAD:6379` on the other machines) "
            f"or set RAY_ADDRESS ({exc})"
        ) from None
    return True


def _check_reachable(address: str) -> None:
    """ConnectionError unless a cluster's HOST:PORT accepts connections (Ray itself retries
    an unreachable address for minutes)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return  # none given, "auto", or a Ray Client address: Ray's own checks
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ConnectionError(f"RAY_ADDRESS={address} does not answer: {exc}") from None
