"""Socket security: nobody without the run's credentials can make the engine do anything.

Every engine socket speaks CURVE with per-run keys and a ZAP check of the client key; the ipc
socket files are 0600 in a 0700 run directory. An intruder that connects to each socket (with
no keys, or with keys of its own) and sends garbage, a forged StepResult, Shutdown, a
GenerateRequest or an AddRequest changes nothing, and the engine keeps serving. The workers'
plan channels are bound by the scheduler (a worker may run on another machine): an intruder
that connects there to take the plans gets none, and the engine keeps serving.
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
from pagedserve.actors.security import CREDENTIALS_FILE, Credentials
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


def intrude(address: str, kind: int, keys: Credentials | None) -> bool:
    """Connect, send every forgery, and report whether anything came back."""
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:  # keys of its own, and the server's public key (stolen, say)
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
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


@pytest.mark.parametrize("with_own_keys", [False, True], ids=["no keys", "own keys"])
def test_a_process_without_the_credentials_cannot_make_the_engine_do_anything(
    engine: Supervisor, with_own_keys: bool
) -> None:
    address = engine.addresses.engine_address
    with Client(address) as client:
        expected = [t for d in client.generate([5, 6, 7], GREEDY) for t in d.token_ids]
        before = client.stats()
    stolen_server_key = engine.credentials.server_public
    for name, (socket_address, kind) in engine_sockets(engine).items():
        keys = None
        if with_own_keys:
            own = Credentials.generate()
            keys = Credentials(
                server_public=stolen_server_key,
                client_public=own.client_public,
                client_secret=own.client_secret,
            )
        assert not intrude(socket_address, kind, keys), f"{name} answered an intruder"
    with Client(address) as client:
        after = client.stats()
        again = [t for d in client.generate([5, 6, 7], GREEDY) for t in d.token_ids]
    assert again == expected
    assert engine.restarts == {} and engine.dead_reason is None
    # the intruder's requests never ran: only the two of ours and the stats counted
    assert after.num_prompt_tokens == before.num_prompt_tokens
    assert all(a.state == "running" for a in engine.status().actors)
    assert all(a.stats is None or a.stats.rejected == 0 for a in engine.status().actors)


def test_an_intruder_on_the_plan_channel_takes_no_plan(engine: Supervisor) -> None:
    """Without CURVE the scheduler's PUSH would deal plans to the intruder too (and the
    engine would stall); with it, the handshake fails and every plan reaches the worker."""
    own = Credentials.generate()
    ctx = zmq.Context()
    thief = ctx.socket(zmq.PULL)
    thief.setsockopt(zmq.CURVE_SERVERKEY, engine.credentials.server_public)
    thief.setsockopt(zmq.CURVE_PUBLICKEY, own.client_public)
    thief.setsockopt(zmq.CURVE_SECRETKEY, own.client_secret)
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
    assert zmq.curve_public(first.client_secret) == first.client_public
