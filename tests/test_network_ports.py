"""The tcp ports an engine spread over machines binds (actors/network.py): chosen free and
outside the kernel's ephemeral range, where any process's outgoing connection may take one
between the choice and the actor's bind (a CI run lost the scheduler's port that way)."""

from __future__ import annotations

from pagedserve.actors import network


def test_port_ranges_leave_out_the_ephemeral_ports() -> None:
    ephemeral = range(32768, 61000)
    assert network.port_ranges((20000, 60000), ephemeral, 18) == [(20000, 32768)]
    assert network.port_ranges((20000, 65536), ephemeral, 18) == [(20000, 32768), (61000, 65536)]
    # nothing outside it holds the block: the whole range, rather than no port at all
    assert network.port_ranges((32768, 60000), ephemeral, 18) == [(32768, 60000)]


def test_planned_ports_are_outside_the_ephemeral_range() -> None:
    ephemeral = network.ephemeral_ports()
    for _ in range(20):
        planned = network.plan_network("127.0.0.1", num_workers=2)
        bus_ports = range(planned.base_port, planned.base_port + 16 + 2)
        assert not set(bus_ports) & set(ephemeral)
        assert planned.rendezvous_port not in ephemeral
        assert planned.rendezvous_port not in bus_ports
