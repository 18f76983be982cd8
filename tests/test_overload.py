"""Overload: ten times more concurrent requests than the engine lets wait.

Real processes (the supervisor, every actor, the HTTP server). Each wave sends 10x the waiting
limit at once: the requests beyond what runs and waits are refused at once with a 503 that
says when to retry (Retry-After), every other one completes with the text an undisturbed run
gives, and no process grows with the waves (admission control keeps every queue, and memory,
bounded). Afterwards the engine serves and every KV block is free.
"""

from __future__ import annotations

import json
import time

import anyio
import httpx2 as httpx
import psutil
import pytest

from pagedserve.actors.supervisor import Supervisor
from pagedserve.api.errors import RETRY_AFTER_S
from pagedserve.config import EngineConfig, ServerConfig
from tests.engine_settings import NO_STANDBY
from tests.test_openai_server import free_port
from tests.test_server_fuzz import metric

WAITING_LIMIT = 4
CONCURRENT = 10 * WAITING_LIMIT
NUM_KV_BLOCKS = 256
PROMPTS = ["ROMEO:", "To be, or not", "JULIET: O Romeo", "First Citizen:"]
MAX_TOKENS = 8
# What any one process may grow by from the end of the first wave to the end of the last
# (the worker's first batches of each size grow its allocator's pools; nothing grows per
# request: a queue without a bound would grow by the requests it kept).
RSS_GROWTH_BOUND = 16 * 2**20
NUM_WAVES = 3


@pytest.fixture(scope="module")
def server():
    port = free_port()
    config = EngineConfig(
        num_kv_blocks=NUM_KV_BLOCKS,
        max_num_seqs=2,  # few run at once, so that the waiting queue fills
        max_waiting_requests=WAITING_LIMIT,
        server=ServerConfig(port=port),
        supervision=NO_STANDBY,
    )
    supervisor = Supervisor(config)
    supervisor.start(extra_actors=("api-server",))
    try:
        yield supervisor, f"http://127.0.0.1:{port}"
    finally:
        supervisor.stop()


def body(index: int, stream: bool) -> dict:
    return {
        "prompt": PROMPTS[index % len(PROMPTS)], "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "stream": stream,
    }  # fmt: skip


async def one(http: httpx.AsyncClient, index: int) -> tuple[int, dict[str, str], str]:
    """(status, headers, text of the completion or the error body) of request `index`."""
    stream = index % 2 == 1
    async with http.stream("POST", "/v1/completions", json=body(index, stream)) as reply:
        raw = (await reply.aread()).decode()
    if reply.status_code != 200:
        return reply.status_code, dict(reply.headers), raw
    if not stream:
        return 200, dict(reply.headers), json.loads(raw)["choices"][0]["text"]
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: {")]
    return 200, dict(reply.headers), "".join(json.loads(e)["choices"][0]["text"] for e in events)


async def wave(base_url: str) -> list[tuple[int, dict[str, str], str]]:
    replies: list = [None] * CONCURRENT
    limits = httpx.Limits(max_connections=CONCURRENT)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as http:

        async def run(index: int) -> None:
            replies[index] = await one(http, index)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for index in range(CONCURRENT):
                    tg.start_soon(run, index)
    return replies


def rss_of_each(supervisor: Supervisor) -> dict[str, int]:
    return {
        label: psutil.Process(process.pid).memory_info().rss
        for label, process in supervisor.processes.items()
    }


def check_wave(replies: list, reference: list[str]) -> tuple[int, int]:
    """Every reply is a completion equal to the undisturbed one, or a 503 with Retry-After;
    (completed, refused)."""
    completed = refused = 0
    for index, (status, headers, text) in enumerate(replies):
        if status == 200:
            assert text == reference[index % len(PROMPTS)], index
            completed += 1
        else:
            assert status == 503, (status, text)
            assert headers["retry-after"] == str(RETRY_AFTER_S)
            error = json.loads(text)["error"]
            assert "overloaded" in error["message"] and error["code"] == "engine_unavailable"
            refused += 1
    return completed, refused


async def test_ten_times_the_waiting_limit_the_excess_is_refused_the_rest_complete(
    server,
) -> None:
    supervisor, base_url = server
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        reference = [(await one(http, i))[2] for i in range(len(PROMPTS))]  # one at a time
    assert all(reference)
    rss: list[dict[str, int]] = []
    for _ in range(NUM_WAVES):
        t0 = time.monotonic()
        completed, refused = check_wave(await wave(base_url), reference)
        # the first WAITING_LIMIT to arrive find the queue empty; beyond the running ones
        # and the queue, every request is refused
        assert completed >= WAITING_LIMIT and refused >= 1, (completed, refused)
        assert completed + refused == CONCURRENT
        rss.append(rss_of_each(supervisor))
        print(
            f"{time.monotonic() - t0:.1f} s, completed {completed}, refused {refused}, RSS MiB",
            {label: round(value / 2**20, 1) for label, value in rss[-1].items()},
        )
    grown = {label: rss[-1][label] - rss[0][label] for label in rss[0]}
    assert all(g < RSS_GROWTH_BOUND for g in grown.values()), grown
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        assert (await one(http, 0))[2] == reference[0]  # still serving
        deadline = time.monotonic() + 10
        while metric((await http.get("/metrics")).text, "kv_cache_free_blocks") != NUM_KV_BLOCKS:
            assert time.monotonic() < deadline, "KV blocks still held after the waves"
            await anyio.sleep(0.1)
