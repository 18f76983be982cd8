"""A view of each actor: process titles, per-actor counters in /metrics, `pagedserve top`.

Every actor reports busy and idle time, messages in and out, rejected frames, queue depths and
memory in its heartbeats; the supervisor adds restarts and serves the table on its status
socket, which /metrics and `pagedserve top` read.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx2 as httpx
import psutil
import pytest

from pagedserve import SamplingParams
from pagedserve.actors.supervisor import Supervisor
from pagedserve.api.actor_status import StatusClient
from pagedserve.api.client import Client
from pagedserve.config import EngineConfig, ServerConfig
from tests.test_openai_server import free_port

ACTOR_TITLES = {
    "pagedserve:api-server",
    "pagedserve:tokenizer",
    "pagedserve:detokenizer",
    "pagedserve:scheduler",
    "pagedserve:worker0",
}


@pytest.fixture(scope="module")
def server():
    port = free_port()
    config = EngineConfig(num_kv_blocks=256, server=ServerConfig(port=port))
    supervisor = Supervisor(config)
    supervisor.start(extra_actors=("api-server",))
    try:
        with Client(supervisor.addresses.engine_address) as client:  # some traffic
            for delta in client.generate("ROMEO:", SamplingParams(max_tokens=8)):
                assert delta.seq == 0
        time.sleep(1.5)  # a heartbeat after it
        yield supervisor, f"http://127.0.0.1:{port}"
    finally:
        supervisor.stop()


def test_every_actor_process_has_a_title(server) -> None:
    supervisor, _ = server
    processes = map(psutil.Process, actor_pids(supervisor))
    titles = {" ".join(p.cmdline()).strip(): p.pid for p in processes}
    assert set(titles) == ACTOR_TITLES
    assert titles["pagedserve:worker0"] == supervisor.processes["worker"].pid
    standbys = [
        p.cmdline()[0]
        for p in psutil.Process().children()
        if p.cmdline()[0].startswith("pagedserve:standby-")
    ]
    assert "pagedserve:standby-worker" in standbys  # a restart skips the imports


def actor_pids(supervisor: Supervisor) -> list[int]:
    return [process.pid for process in supervisor.processes.values()]


def test_the_status_socket_counts_each_actors_work(server) -> None:
    supervisor, _ = server
    client = StatusClient(supervisor.addresses.engine_address)
    try:
        status = client.fetch()
    finally:
        client.close()
    actors = {a.label: a for a in status.actors}
    assert set(actors) == {"worker", "scheduler", "tokenizer", "detokenizer", "api-server"}
    for actor in actors.values():
        assert actor.state == "running" and actor.restarts == 0
        assert actor.stats is not None and actor.stats.uptime_s > 0
        assert 0 < actor.stats.busy_s <= actor.stats.cpu_s + 0.01
        assert actor.stats.rss_bytes > 10 * 2**20
        gc = actor.stats.gc  # the start-up heap frozen: later collections do not walk it
        assert gc.frozen > 10_000, actor.label
        assert gc.collections >= gc.full_collections >= 0
        assert 0 <= gc.max_pause_s <= gc.pause_s or gc.collections == 0
    scheduler = actors["scheduler"].stats
    assert scheduler is not None and scheduler.messages_in >= 8 and scheduler.messages_out >= 8
    assert set(scheduler.queues) == {"waiting", "running", "inflight_steps"}
    assert set(actors["worker"].stats.queues) == {"batch"}  # type: ignore[union-attr]


def test_metrics_export_every_actor(server) -> None:
    _, base_url = server
    text = httpx.get(base_url + "/metrics", timeout=10).text
    for label in ("worker", "scheduler", "tokenizer", "detokenizer", "api-server"):
        assert f'pagedserve:actor_up{{actor="{label}"}} 1.0' in text
        assert f'pagedserve:actor_restarts_total{{actor="{label}"}} 0.0' in text
        assert re.search(rf'pagedserve:actor_busy_seconds_total{{actor="{label}"}} [0-9.]+', text)
    match = re.search(r'pagedserve:actor_messages_in_total{actor="scheduler"} ([0-9.e+]+)', text)
    assert match and float(match.group(1)) >= 8
    assert 'pagedserve:actor_queue_depth{actor="scheduler",queue="waiting"} 0.0' in text
    for generation in ("all", "2"):
        labels = f'{{actor="worker",generation="{generation}"}}'
        assert re.search(rf"pagedserve:actor_gc_pause_seconds_total{labels} [0-9.e+-]+", text)


def test_pagedserve_top_shows_a_table_of_actors(server) -> None:
    supervisor, _ = server
    result = subprocess.run(
        [sys.executable, "-m", "pagedserve.api.cli", "top", supervisor.addresses.engine_address,
         "--iterations", "2", "--interval", "0.5"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    tables = result.stdout.split("pagedserve  epoch")
    assert len(tables) == 3  # two refreshes
    last = tables[-1]
    for label, process in supervisor.processes.items():
        assert re.search(rf"^{re.escape(label)} +{process.pid} +running", last, re.M), last
    assert "BUSY%" in last and "GC ms" in last and "QUEUES" in last and "inflight_steps=" in last
