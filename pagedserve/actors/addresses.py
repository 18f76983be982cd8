"""Where every socket of an engine lives: ipc:// files in a private run directory, or
consecutive tcp ports. A client reaches the engine by one *engine address*: `ipc://<run_dir>`
or `tcp://host:port0`."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Addresses:
    """Where every actor's sockets live: ipc:// files in `run_dir`, or consecutive tcp ports
    from `tcp_base_port` on `tcp_host`."""

    run_dir: str
    tcp_host: str | None = None
    tcp_base_port: int = 0

    @classmethod
    def from_engine_address(cls, address: str) -> Addresses:
        """The addresses behind an engine address (what `pagedserve serve` prints)."""
        if address.startswith("ipc://"):
            return cls(address.removeprefix("ipc://"))
        if address.startswith("tcp://"):
            host, _, port = address.removeprefix("tcp://").rpartition(":")
            if host and port.isdigit():
                return cls("", host, int(port))
        raise ValueError(f"not an engine address: {address!r} (ipc://DIR or tcp://HOST:PORT)")

    @property
    def engine_address(self) -> str:
        if self.tcp_host is not None:
            return f"tcp://{self.tcp_host}:{self.tcp_base_port}"
        return f"ipc://{self.run_dir}"

    def _address(self, name: str, index: int) -> str:
        if self.tcp_host is not None:
            return f"tcp://{self.tcp_host}:{self.tcp_base_port + index}"
        return f"ipc://{os.path.join(self.run_dir, name)}"

    @property
    def supervisor(self) -> str:
        return self._address("supervisor.sock", 0)

    @property
    def status(self) -> str:
        """The supervisor's ROUTER: the table of actors (`pagedserve top`, /metrics)."""
        return self._address("status.sock", 5)

    @property
    def requests(self) -> str:
        """The tokenizer's ROUTER: clients send their requests here."""
        return self._address("requests.sock", 1)

    @property
    def outputs(self) -> str:
        """The detokenizer's ROUTER: clients receive their deltas from here."""
        return self._address("outputs.sock", 2)

    @property
    def detokenizer_inbox(self) -> str:
        return self._address("detokenizer-inbox.sock", 3)

    @property
    def scheduler_inbox(self) -> str:
        return self._address("scheduler-inbox.sock", 4)

    def worker_inbox(self, rank: int) -> str:
        """Step plans to worker `rank`: bound by the scheduler (a worker may run on another
        machine, so it connects), unlike the other inboxes."""
        return self._address(f"worker-{rank}-inbox.sock", 16 + rank)
