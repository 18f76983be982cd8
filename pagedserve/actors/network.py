"""The engine's wiring between processes, in one place: where its sockets live and where its
workers meet for torch.distributed.

On one machine (config.network None): ipc:// sockets in the run directory, and the workers'
rendezvous in a file there. Spread over machines (the Ray executor: config.network set by
the supervisor): every bound socket is on tcp://host:base_port + k of the supervisor's machine
(addresses.py), the only sockets a worker binds are none (it connects to the scheduler, which
binds its plan channels), and the rendezvous is a torch.distributed TCPStore that the
supervisor hosts on tcp://host:rendezvous_port. Each incarnation of the worker group (a
restart moves the epoch) meets under its own key prefix, or in its own file.

Every socket is made by bus.py (whose contexts carry the engine's credentials), so tcp
sockets are authenticated as ipc ones are.
"""

from __future__ import annotations

import datetime
import os
import random
import socket
from typing import TYPE_CHECKING

from pagedserve.actors.addresses import Addresses
from pagedserve.config import EngineConfig, NetworkConfig

if TYPE_CHECKING:
    import torch.distributed as dist

# Ports of addresses.Addresses: base + 0..15 for the actors, base + 16 + rank for the workers
_BUS_PORTS = 16
_PORT_RANGE = (20000, 60000)
_PORT_TRIES = 200
_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def engine_addresses(run_dir: str, network: NetworkConfig | None) -> Addresses:
    """Every actor's sockets: ipc in run_dir, or tcp on the supervisor's machine."""
    if network is None:
        return Addresses(run_dir)
    return Addresses(run_dir, network.host, network.base_port)


def plan_network(host: str, num_workers: int) -> NetworkConfig:
    """Free tcp ports on `host` (this machine's address that the others reach): a block for
    the bus, one for the rendezvous."""
    base = _free_port_block(host, _BUS_PORTS + num_workers)
    rendezvous = _free_port_block(host, 1, avoid=range(base, base + _BUS_PORTS + num_workers))
    return NetworkConfig(host=host, base_port=base, rendezvous_port=rendezvous)


def _free_port_block(host: str, count: int, avoid: range = range(0)) -> int:
    """A block of `count` ports free now, outside the kernel's ephemeral range: the actors bind
    theirs only later, and a port of that range may meanwhile become the local end of any
    process's outgoing connection (Ray's, the rendezvous')."""
    rng = random.Random()
    ranges = port_ranges(_PORT_RANGE, ephemeral_ports(), count)
    for _ in range(_PORT_TRIES):
        low, high = rng.choice(ranges)
        base = rng.randrange(low, high - count + 1)
        ports = range(base, base + count)
        if not set(ports) & set(avoid) and all(_port_free(host, p) for p in ports):
            return base
    raise RuntimeError(f"found no {count} consecutive free tcp ports on {host}")


def ephemeral_ports() -> range:
    """The ports the kernel picks an outgoing connection's local end from (Linux: the
    ip_local_port_range sysctl; elsewhere, IANA's dynamic range)."""
    try:
        with open(_EPHEMERAL_RANGE_FILE) as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):
        low, high = 49152, 65535
    return range(low, high + 1)


def port_ranges(allowed: tuple[int, int], ephemeral: range, count: int) -> list[tuple[int, int]]:
    """The parts [low, high) of `allowed` outside `ephemeral` that hold `count` ports; all of
    `allowed` when no part does (a kernel that lends nearly every port)."""
    low, high = allowed
    parts = [(low, min(high, ephemeral.start)), (max(low, ephemeral.stop), high)]
    parts = [(a, b) for a, b in parts if b - a >= count]
    return parts or [allowed]


def _port_free(host: str, port: int) -> bool:
    try:
        socket.create_server((host, port)).close()
    except OSError:
        return False
    return True


def rendezvous_store(config: EngineConfig, run_dir: str, epoch: int) -> dist.Store:
    """Where the workers of group incarnation `epoch` meet (see the module docstring)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=config.collective_timeout_s)
    if config.network is None:
        path = os.path.join(run_dir, f"workers-{epoch}.store")
        return dist.FileStore(path, config.world_size)
    store = dist.TCPStore(
        config.network.host, config.network.rendezvous_port, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"workers-{epoch}", store)


class RendezvousServer:
    """The TCPStore the workers of a multi-machine engine meet at, hosted by the supervisor
    for the engine's lifetime."""

    def __init__(self, network: NetworkConfig) -> None:
        import torch.distributed as dist

        self.store = dist.TCPStore(
            network.host, network.rendezvous_port, is_master=True, wait_for_workers=False
        )

    def close(self) -> None:
        del self.store
