"""Supervision: any actor may die (kill -9) or hang, and the engine keeps every request.

Real processes throughout: the supervisor, the actors, the ZeroMQ clients and the HTTP server.
A killed actor is restarted at a new epoch; requests in flight continue (recomputed from their
prompt and the tokens already delivered) and end with the text of an undisturbed run, greedy
or seeded (half of the 20 streams sample with a seed). An actor
that can no longer start ends every waiting request with a 503 and turns /health to 503.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import anyio
import httpx2 as httpx
import pytest

from pagedserve import SamplingParams
from pagedserve.actors import bus
from pagedserve.actors.messages import ActorFailed
from pagedserve.actors.supervisor import Supervisor
from pagedserve.api.client import AsyncClient, Client
from pagedserve.api.client_core import EngineRequestError
from pagedserve.config import EngineConfig, ServerConfig, SupervisionConfig
from tests.engine_settings import NO_STANDBY
from tests.test_openai_server import free_port
from tests.tiny_models import random_prompts, save_tiny_model

PROMPTS = random_prompts(4096, [5, 9, 14, 20] * 5, seed=11)
ACTORS = ["worker", "scheduler", "tokenizer", "detokenizer", "api-server"]
# a stopped actor is found hung after this long (the default, 20 s, would be waited out)
HEARTBEAT_TIMEOUT_S = 5.0


def greedy(max_tokens: int = 32) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def stream_params(index: int) -> SamplingParams:
    """Stream `index`'s settings: greedy, or (odd ones) seeded sampling."""
    if index % 2 == 0:
        return greedy()
    return SamplingParams(temperature=0.8, seed=1000 + index, max_tokens=32, ignore_eos=True)


def solo_tokens(address: str, prompt: list[int], params: SamplingParams) -> list[int]:
    with Client(address, connect_timeout_s=30) as client:
        return [t for d in client.generate(prompt, params) for t in d.token_ids]


@pytest.fixture(scope="module")
def engine():
    port = free_port()
    config = EngineConfig(
        num_kv_blocks=512,
        server=ServerConfig(port=port),
        supervision=SupervisionConfig(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S),
    )
    supervisor = Supervisor(config)
    supervisor.start(extra_actors=("api-server",))
    try:
        yield supervisor, f"http://127.0.0.1:{port}"
    finally:
        supervisor.stop()


@pytest.fixture(scope="module")
def undisturbed(engine) -> list[list[int]]:
    results = anyio.run(streams_with_a_fault, engine[0], lambda: None)
    return [results[i] for i in range(len(PROMPTS))]


async def streams_with_a_fault(supervisor: Supervisor, fault) -> dict[int, list[int]]:
    """20 concurrent streams (greedy and seeded); `fault()` (a function or a coroutine
    function) runs once they have produced tokens."""
    results: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    async with AsyncClient(supervisor.addresses.engine_address) as client:

        async def run(index: int) -> None:
            async for delta in client.generate(PROMPTS[index], stream_params(index)):
                results[index] += delta.token_ids

        async def inject() -> None:
            while sum(map(len, results.values())) < 60:  # the streams are running
                await anyio.sleep(0.005)
            done = fault()
            if done is not None:
                await done

        with anyio.fail_after(90):
            async with anyio.create_task_group() as tg:
                for i in range(len(PROMPTS)):
                    tg.start_soon(run, i)
                tg.start_soon(inject)
    return results


def wait_for_restart(supervisor: Supervisor, name: str, count: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while supervisor.restarts.get(name, 0) < count or any(
        a.state != "running" for a in supervisor.status().actors
    ):
        assert time.monotonic() < deadline, f"{name} was not restarted"
        assert supervisor.dead_reason is None, supervisor.dead_reason
        time.sleep(0.05)


@pytest.mark.parametrize("victim", ["worker", "scheduler", "tokenizer", "detokenizer"])
async def test_kill_9_during_20_streams_loses_no_request(engine, undisturbed, victim) -> None:
    supervisor, _ = engine
    before = supervisor.restarts.get(victim, 0)
    pid = supervisor.processes[victim].pid
    results = await streams_with_a_fault(supervisor, lambda: os.kill(pid, signal.SIGKILL))
    assert [results[i] for i in range(len(PROMPTS))] == undisturbed
    # the streams may all end before the restart does (the tokenizer's, the detokenizer's)
    wait_for_restart(supervisor, victim, before + 1)
    assert supervisor.restarts[victim] == before + 1 and supervisor.dead_reason is None
    stats = Client(supervisor.addresses.engine_address).stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # nothing leaked


async def test_kill_9_of_the_api_server_other_connections_unaffected(engine, undisturbed) -> None:
    """ZeroMQ clients do not notice; the HTTP server is back within 5 s and serves new
    connections (streams open on the killed server end with it)."""
    supervisor, base_url = engine
    replies: list[tuple[int, float]] = []

    async def kill_then_connect() -> None:
        killed_at = time.monotonic()
        os.kill(supervisor.processes["api-server"].pid, signal.SIGKILL)
        async with httpx.AsyncClient(timeout=30) as http:  # waits in the listener's backlog
            reply = await http.post(
                base_url + "/v1/completions",
                json={"prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0},
            )
        replies.append((reply.status_code, time.monotonic() - killed_at))

    results = await streams_with_a_fault(supervisor, kill_then_connect)
    assert [results[i] for i in range(len(PROMPTS))] == undisturbed
    [(status, seconds)] = replies
    assert status == 200 and seconds < 5.0, seconds  # served within 5 s of the kill


@pytest.mark.parametrize("victim", ACTORS)
def test_each_actor_killed_10_times_in_a_row_the_engine_still_serves(
    engine, undisturbed, victim
) -> None:
    supervisor, base_url = engine
    address = supervisor.addresses.engine_address
    for _ in range(10):
        before = supervisor.restarts.get(victim, 0)
        os.kill(supervisor.processes[victim].pid, signal.SIGKILL)
        wait_for_restart(supervisor, victim, before + 1)
    assert solo_tokens(address, PROMPTS[3], stream_params(3)) == undisturbed[3]
    reply = httpx.post(
        base_url + "/v1/completions",
        json={"prompt": PROMPTS[3], "max_tokens": 32, "temperature": 0, "ignore_eos": True},
        timeout=30,
    )
    assert reply.status_code == 200
    assert httpx.get(base_url + "/health").status_code == 200


async def test_a_hung_actor_is_killed_and_restarted(engine, undisturbed) -> None:
    """SIGSTOP (the process is alive but its loop never runs): heartbeats stop, and after
    heartbeat_timeout_s the supervisor kills and restarts it."""
    supervisor, _ = engine
    before = supervisor.restarts.get("scheduler", 0)
    pid = supervisor.processes["scheduler"].pid
    results = await streams_with_a_fault(supervisor, lambda: os.kill(pid, signal.SIGSTOP))
    assert [results[i] for i in range(len(PROMPTS))] == undisturbed
    assert supervisor.restarts["scheduler"] == before + 1


async def test_an_actor_that_cannot_start_again_ends_every_request_with_a_503(
    tmp_path: Path,
) -> None:
    """The model no longer loads: after a few failed starts the engine is dead; every waiting
    client gets a 503 at once, new requests too, and /health turns 503."""
    model = save_tiny_model("llama", tmp_path / "model")
    port = free_port()
    config = EngineConfig(model=str(model), num_kv_blocks=256, server=ServerConfig(port=port))
    supervisor = Supervisor(config)
    supervisor.start(extra_actors=("api-server",))
    errors: list[EngineRequestError] = []
    dead_at: list[float] = []
    try:
        async with AsyncClient(supervisor.addresses.engine_address) as client:

            async def run(prompt: list[int]) -> None:
                with pytest.raises(EngineRequestError) as refused:
                    async for _ in client.generate(prompt, greedy(2000)):
                        pass
                errors.append(refused.value)

            async def break_the_model() -> None:
                await anyio.sleep(1.0)
                shutil.rmtree(model / "model.safetensors", ignore_errors=True)
                (model / "model.safetensors").write_bytes(b"not a model")
                os.kill(supervisor.processes["worker"].pid, signal.SIGKILL)
                while supervisor.dead_reason is None:
                    await anyio.sleep(0.05)
                dead_at.append(time.monotonic())

            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    for prompt in random_prompts(300, [6] * 8, seed=1):
                        tg.start_soon(run, prompt)
                    tg.start_soon(break_the_model)
            assert time.monotonic() - dead_at[0] < 3.0
            with pytest.raises(EngineRequestError) as late:
                async for _ in client.generate([1, 2, 3], greedy()):
                    pass
        assert len(errors) == 8 and {e.status_code for e in errors} == {503}
        assert late.value.status_code == 503 and "could not be restarted" in str(late.value)
        deadline = time.monotonic() + 3.0  # the server hears it with its next ping (1 s)
        while httpx.get(f"http://127.0.0.1:{port}/health").status_code != 503:
            assert time.monotonic() < deadline, "/health did not turn 503"
            time.sleep(0.1)
    finally:
        supervisor.stop()


def test_the_restart_budget_is_a_rate_not_a_lifetime_count() -> None:
    """One restart per window: a second kill after the window is restarted (a lifetime count
    of one would end the engine there), a kill within the window of the last restart ends it,
    and a client is told so with a 503."""
    window_s = 8.0
    supervision = SupervisionConfig(restart_budget=1, restart_window_s=window_s)
    supervisor = Supervisor(EngineConfig(num_kv_blocks=128, supervision=supervision))
    supervisor.start()
    try:
        address = supervisor.addresses.engine_address
        expected = solo_tokens(address, PROMPTS[0], greedy(4))
        for restarts in (1, 2):
            os.kill(supervisor.processes["tokenizer"].pid, signal.SIGKILL)
            wait_for_restart(supervisor, "tokenizer", restarts)
            restarted_at = time.monotonic()  # the restart counted before it started
            assert solo_tokens(address, PROMPTS[0], greedy(4)) == expected
            if restarts == 1:
                time.sleep(max(0.0, restarted_at + window_s - time.monotonic()))
        os.kill(supervisor.processes["tokenizer"].pid, signal.SIGKILL)  # within the window
        deadline = time.monotonic() + 10
        while supervisor.dead_reason is None:
            assert time.monotonic() < deadline, "the spent budget did not end the engine"
            time.sleep(0.05)
        assert "the restart budget of tokenizer is spent" in supervisor.dead_reason
        assert supervisor.restarts == {"tokenizer": 2}
        with pytest.raises(EngineRequestError) as refused:
            solo_tokens(address, PROMPTS[0], greedy(4))
        assert refused.value.status_code == 503
    finally:
        supervisor.stop()


def test_a_failure_report_of_a_replaced_process_does_not_fail_its_successor() -> None:
    """A process killed for a restart may report its own failure late (a worker whose peer rank
    died sees its connection reset), after its successor was spawned: the report is not the
    successor's failure to start, so the restart succeeds at its first try."""
    # no standby: the successor loads the model, so the late report comes before it is ready
    supervisor = Supervisor(EngineConfig(num_kv_blocks=128, supervision=NO_STANDBY))
    supervisor.start()
    ctx = bus.sync_context(supervisor.credentials)
    try:
        address = supervisor.addresses.engine_address
        expected = solo_tokens(address, PROMPTS[0], greedy(4))
        killed = supervisor.processes["worker"].pid
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while supervisor.processes["worker"].pid == killed:  # the successor is spawned
            assert time.monotonic() < deadline, "the worker was not restarted"
            time.sleep(0.005)
        push = bus.push_socket(ctx, supervisor.addresses.supervisor)
        push.send(bus.encode(ActorFailed("worker", "connection reset", pid=killed)))
        push.close(linger=5000)
        wait_for_restart(supervisor, "worker", 1)
        assert solo_tokens(address, PROMPTS[0], greedy(4)) == expected
        assert supervisor.restarts == {"worker": 1} and supervisor.dead_reason is None
    finally:
        ctx.destroy()
        supervisor.stop()
