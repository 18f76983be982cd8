"""Socket security: nobody without the run's credentials can make the engine do anything.

Every engine socket checks who connects, in a ZAP handler of the binding process: the run's
password (PLAIN) on ipc sockets, whose files are 0600 in a 0700 run directory, and the run's
CURVE client key on tcp sockets. An intruder that connects to each socket (with no
credentials, with CURVE keys of its own, or with a wrong password) and sends garbage, a forged
StepResult, Shutdown, a GenerateRequest or an AddRequest changes nothing, and the engine keeps
serving. The workers' plan channels are bound by the scheduler (a worker may run on another
machine): an intruder that connects there to take the plans gets none, and the engine keeps
serving.
"""

from __future__ import annotations

import os
import stat
import time

import pytest
import zmq

from pagedserve import SamplingParams
from pagedserve.actors import bus
from pagedserve.actors import messages as m
from pagedserve.actors.security import CREDENTIALS_FILE, PLAIN_USERNAME, Credentials
from pagedserve.actors.supervision_messages import StatusRequest
from pagedserve.actors.supervisor import Supervisor
from pagedserve.api.client import Client
from pagedserve.api.client_core import EngineUnavailableError
from pagedserve.config import EngineConfig
from tests.engine_settings import NO_STANDBY

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
FORGERIES = [
    b"\xc1 garbage",
    bus.encode(m.StepResult(step_id=0, handles=[0], sampled_token_ids=[5])),
    bus.encode(m.Shutdown("intruder")),
    bus.encode(m.GenerateRequest(seq=1, sampling=GREEDY, prompt_token_ids=[1, 2, 3])),
    bus.encode(
        m.AddRequest(
            client=b"x", seq=1, prompt_token_ids=[1, 2, 3], sampling=GREEDY, eos_token_ids=[]
        )
    ),  # fmt: skip
    bus.encode(m.WorkersLost(99)),
    bus.encode(m.EngineFailed("forged")),
    bus.encode(StatusRequest()),
]


@pytest.fixture(scope="module")
def engine():
    supervisor = Supervisor(EngineConfig(num_kv_blocks=256, supervision=NO_STANDBY))
    supervisor.start()
    try:
        yield supervisor
    finally:
        supervisor.stop()


def engine_sockets(supervisor: Supervisor) -> dict[str, tuple[str, int]]:
    """Every socket an actor or the supervisor binds, with the socket type to reach it."""
    a = supervisor.addresses
    return {
        "requests": (a.requests, zmq.DEALER),
        "outputs": (a.outputs, zmq.DEALER),
        "detokenizer inbox": (a.detokenizer_inbox, zmq.PUSH),
        "scheduler inbox": (a.scheduler_inbox, zmq.PUSH),
        "worker inbox": (a.worker_inbox(0), zmq.PULL),  # the scheduler binds it
        "supervisor": (a.supervisor, zmq.PUSH),
        "status": (a.status, zmq.DEALER),
    }


def test_run_directory_sockets_and_credentials_are_private(engine: Supervisor) -> None:
    assert stat.S_IMODE(os.stat(engine.run_dir).st_mode) == 0o700
    for address, _ in engine_sockets(engine).values():
        path = address.removeprefix("ipc://")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    credentials = os.path.join(engine.run_dir, CREDENTIALS_FILE)
    assert stat.S_IMODE(os.stat(credentials).st_mode) == 0o600
    assert Credentials.read(credentials).server_secret == b""  # clients never get it


def forged_credentials(sock: zmq.Socket, engine: Supervisor, way: str) -> None:
    """An intruder's try: `own keys` (CURVE keys of its own, with the server's public key,
    stolen say), `wrong password` (PLAIN, the right user name), or none at all."""
    own = Credentials.generate()
    if way == "own keys":
        sock.setsockopt(zmq.CURVE_SERVERKEY, engine.credentials.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, own.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, own.client_secret)
    elif way == "wrong password":
        sock.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USERNAME)
        sock.setsockopt(zmq.PLAIN_PASSWORD, own.password)


def intrude(address: str, kind: int, engine: Supervisor, way: str) -> bool:
    """Connect, send every forgery, and report whether anything came back."""
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    forged_credentials(sock, engine, way)
    try:
        sock.connect(address)
        for frame in FORGERIES if kind != zmq.PULL else []:
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                pass
        answered = kind in (zmq.DEALER, zmq.PULL) and bool(sock.poll(500))
        time.sleep(0.2)
        return answered
    finally:
        sock.close(0)
        ctx.term()


@pytest.mark.parametrize("way", ["no credentials", "own keys", "wrong password"])
def test_a_process_without_the_credentials_cannot_make_the_engine_do_anything(
    engine: Supervisor, way: str
) -> None:
    address = engine.addresses.engine_address
    with Client(address) as client:
        expected = [t for d in client.generate([5, 6, 7], GREEDY) for t in d.token_ids]
        before = client.stats()
    for name, (socket_address, kind) in engine_sockets(engine).items():
        assert not intrude(socket_address, kind, engine, way), f"{name} answered an intruder"
    with Client(address) as client:
        after = client.stats()
        again = [t for d in client.generate([5, 6, 7], GREEDY) for t in d.token_ids]
    assert again == expected
    assert engine.restarts == {} and engine.dead_reason is None
    # the intruder's requests never ran: only the two of ours and the stats counted
    assert after.num_prompt_tokens == before.num_prompt_tokens
    assert all(a.state == "running" for a in engine.status().actors)
    assert all(a.stats is None or a.stats.rejected == 0 for a in engine.status().actors)


@pytest.mark.parametrize("way", ["own keys", "wrong password"])
def test_an_intruder_on_the_plan_channel_takes_no_plan(engine: Supervisor, way: str) -> None:
    """Without authentication the scheduler's PUSH would deal plans to the intruder too (and
    the engine would stall); with it, the handshake fails and every plan reaches the worker."""
    ctx = zmq.Context()
    thief = ctx.socket(zmq.PULL)
    forged_credentials(thief, engine, way)
    try:
        thief.connect(engine.addresses.worker_inbox(0))
        time.sleep(0.2)
        with Client(engine.addresses.engine_address) as client:
            for prompt in ([5, 6, 7], [8, 9], [10]):
                tokens = [t for d in client.generate(prompt, GREEDY) for t in d.token_ids]
                assert len(tokens) == GREEDY.max_tokens
        assert not thief.poll(100)
    finally:
        thief.close(0)
        ctx.term()


def test_a_client_needs_the_credentials(engine: Supervisor, tmp_path) -> None:
    """A client with the wrong keys gets no answer: the engine stays unreachable to it."""
    wrong = Credentials.generate().for_clients()
    with pytest.raises(EngineUnavailableError):
        Client(engine.addresses.engine_address, connect_timeout_s=1.0, credentials=wrong)
    with pytest.raises(EngineUnavailableError, match="credentials"):
        Client(f"ipc://{tmp_path}", connect_timeout_s=1.0)


def test_credentials_derived_from_an_api_key_are_stable_and_private() -> None:
    first, second = Credentials.from_api_key("k1"), Credentials.from_api_key("k1")
    other = Credentials.from_api_key("k2")
    assert first == second and first.server_public != other.server_public
    assert first.password != other.password and first.password not in (b"", b"k1")
    assert zmq.curve_public(first.client_secret) == first.client_public


def delivered(server_ctx: zmq.Context, address: str, client: Credentials | None,
              mechanism: str) -> bool:  # fmt: skip
    """Whether a frame from a client of `mechanism` with `client`'s credentials reaches an
    engine socket bound at `address`."""
    inbox = bus.pull_socket(server_ctx, address)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if client is not None and mechanism == "PLAIN":
        sock.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USERNAME)
        sock.setsockopt(zmq.PLAIN_PASSWORD, client.password)
    elif client is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, client.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, client.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, client.client_secret)
    try:
        sock.connect(address)
        sock.send(b"hello", zmq.NOBLOCK) if sock.poll(500, zmq.POLLOUT) else None
        return bool(inbox.poll(500))
    finally:
        sock.close(0)
        ctx.term()
        inbox.close(0)


def test_ipc_sockets_take_the_runs_password_and_tcp_sockets_its_curve_keys(tmp_path) -> None:
    """The mechanism follows the transport: PLAIN on ipc (no per-frame cost), CURVE on tcp
    (encrypted: the password would cross the network in the clear); each refuses the other."""
    run, other = Credentials.generate(), Credentials.generate()
    ctx = bus.sync_context(run)
    try:
        port = 47000 + os.getpid() % 10000
        cases = [
            ("ipc", "PLAIN", run, True), ("ipc", "PLAIN", other, False),
            ("ipc", "CURVE", run, False), ("ipc", None, None, False),
            ("tcp", "CURVE", run, True), ("tcp", "CURVE", other, False),
            ("tcp", "PLAIN", run, False), ("tcp", None, None, False),
        ]  # fmt: skip
        for i, (transport, mechanism, client, expected) in enumerate(cases):
            address = (f"ipc://{tmp_path}/s{i}" if transport == "ipc"
                       else f"tcp://127.0.0.1:{port + i}")  # fmt: skip
            got = delivered(ctx, address, client, mechanism or "")
            assert got == expected, (transport, mechanism, client is run)
    finally:
        ctx.destroy(linger=0)


def test_only_the_engines_own_processes_bind(tmp_path) -> None:
    """A context without the server's secret (a client's, a worker's) cannot bind: a PLAIN
    server without the run's ZAP handler would otherwise admit anyone."""
    ctx = bus.sync_context(Credentials.generate().for_clients())
    try:
        with pytest.raises(PermissionError, match="engine's own processes"):
            bus.pull_socket(ctx, f"ipc://{tmp_path}/s")
    finally:
        ctx.destroy(linger=0)
