"""One owner for request state: handles, counter-based draws, routes and the detokenizer actor.

Through the whole engine (real processes, the ZeroMQ clients): a request's tokens do not depend
on preemption, on which other requests share a step, on how clients name their requests, or on
a huge prompt arriving (the same under actor restarts: test_supervision.py).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import anyio
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.actors.supervisor import Supervisor
from pagedserve.api.client import AsyncClient, Client
from pagedserve.api.client_core import EngineUnavailableError
from pagedserve.config import EngineConfig
from tests.engine_settings import NO_STANDBY
from tests.tiny_models import random_prompts

SHAKESPEARE = [
    "ROMEO:",
    "To be, or not to be",
    "Now is the winter of our discontent",
    "Friends, Romans, countrymen",
    "JULIET:\nO Romeo, Romeo!",
    "All the world's a stage",
    "KING LEAR:",
    "What light through yonder window",
]


def test_seeded_sampling_with_penalties_is_the_same_with_and_without_preemption(
    engine: Supervisor,
) -> None:
    """The scheduler owns what sampling must carry across a preemption (the output so far,
    the RNG key); a resumed request continues exactly where it stopped."""
    params = [
        SamplingParams(
            temperature=0.9,
            top_p=0.9,
            seed=100 + i,
            max_tokens=48,
            ignore_eos=True,
            presence_penalty=0.4,
            frequency_penalty=0.3,
            repetition_penalty=1.2,
        )  # fmt: skip
        for i in range(len(SHAKESPEARE))
    ]
    # the reference: the module's roomy engine (512 blocks), all 8 requests at once
    with Client(engine.addresses.engine_address) as client:
        before = client.stats().num_preemptions
        expected = generate_together(client, SHAKESPEARE, params)
        assert client.stats().num_preemptions == before  # none preempted there
    # 12 blocks of 16 tokens cannot hold 8 requests of ~10 + 48 tokens: preemption
    with LLM(num_kv_blocks=12, enable_prefix_caching=False, supervision=NO_STANDBY) as tight:
        assert tight.config.max_inflight_steps > 1  # asynchronous scheduling is on
        outputs = tight.generate(SHAKESPEARE, params)
        stats = tight.get_stats()
    assert stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.fixture(scope="module")
def engine():
    supervisor = Supervisor(EngineConfig(num_kv_blocks=512, supervision=NO_STANDBY))
    supervisor.start()
    try:
        yield supervisor
    finally:
        supervisor.stop()


def greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def solo_tokens(address: str, prompt: str | list[int], params: SamplingParams) -> list[int]:
    with Client(address) as client:
        return [t for d in client.generate(prompt, params) for t in d.token_ids]


def generate_together(client: Client, prompts: list[str], params: list[SamplingParams]):
    """Each prompt's output tokens, the requests submitted at once."""
    seqs = [client.submit(prompt, p) for prompt, p in zip(prompts, params)]
    tokens: dict[int, list[int]] = {seq: [] for seq in seqs}
    running = set(seqs)
    while running:
        event = client.receive(30_000)
        assert event is not None, "no output"
        if event.seq in running:
            tokens[event.seq] += event.token_ids
            if event.finish_reason is not None:
                running.remove(event.seq)
    return [tokens[seq] for seq in seqs]


async def collect(client: AsyncClient, prompt, params: SamplingParams, label: str | None = None):
    tokens: list[int] = []
    async for delta in client.generate(prompt, params, request_id=label):
        assert label is None or delta.request_id == label
        tokens += delta.token_ids
    return tokens


async def test_clients_may_reuse_labels_freely(engine: Supervisor) -> None:
    """Client ids are labels: the same label twice on one client, or on two clients, gives
    each request its own output."""
    address = engine.addresses.engine_address
    prompts = ["ROMEO:", "KING LEAR:", "All the world's a stage"]
    expected = [solo_tokens(address, p, greedy()) for p in prompts]
    results: dict[int, list[int]] = {}
    async with AsyncClient(address) as first, AsyncClient(address) as second:

        async def run(index: int, client: AsyncClient) -> None:
            results[index] = await collect(client, prompts[index], greedy(), label="same-id")

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, 0, first)
            tg.start_soon(run, 1, first)
            tg.start_soon(run, 2, second)
    assert [results[i] for i in range(3)] == expected


def test_abort_and_readd_of_one_label_in_one_step(engine: Supervisor) -> None:
    """An abort and a new request under the same label, sent back to back (one scheduler
    batch): the new request never sees the old one's in-flight token."""
    address = engine.addresses.engine_address
    old_prompt, new_prompt = random_prompts(4096, [40, 7], seed=3)
    expected = solo_tokens(address, new_prompt, greedy())
    with Client(address) as client:
        client.submit(old_prompt, greedy(200), label="x")
        while not client.receive(5000).token_ids:  # it is running, a token in flight
            pass
        client.abort(["x"])
        new = client.submit(new_prompt, greedy(), label="x")
        tokens: list[int] = []
        while True:
            event = client.receive(10_000)
            assert event is not None, "no output"
            if event.seq == new:
                tokens += event.token_ids
                if event.finish_reason is not None:
                    break
    assert tokens == expected
    assert client.core.requests == {}


HUGE_PROMPT_CLIENT = """
import sys
from pagedserve import SamplingParams
from pagedserve.api.client import Client
from pagedserve.api.client_core import EngineRequestError
with Client(sys.argv[1]) as client:
    sys.stdin.readline()  # imported and connected: wait for the go
    try:
        list(client.generate("All the world's a stage. " * 400_000, SamplingParams(max_tokens=4)))
        print("accepted")
    except EngineRequestError as exc:
        print(exc.status_code, exc)
"""


ENCODE_STALL_MARGIN_S = 1.0


async def test_a_huge_prompt_is_refused_without_stalling_running_streams(
    engine: Supervisor,
) -> None:
    """A 10 MB prompt (from another process) is refused with a 400 before it is encoded, and
    8 running streams keep their pace: encoding never blocks the output path."""
    address = engine.addresses.engine_address
    gaps: dict[int, list[tuple[float, float]]] = {i: [] for i in range(8)}
    window: list[float] = []
    replies: list[str] = []
    async with AsyncClient(address) as client:

        async def stream(index: int) -> None:
            last = None
            async for _ in client.generate(SHAKESPEARE[index], greedy(160)):
                now = time.monotonic()
                if last is not None:
                    gaps[index].append((now, now - last))
                last = now

        async def huge() -> None:
            command = [sys.executable, "-c", HUGE_PROMPT_CLIENT, address]
            async with await anyio.open_process(command) as sender:
                while min(len(g) for g in gaps.values()) < 5:  # the streams are running
                    await anyio.sleep(0.01)
                window.append(time.monotonic())
                assert sender.stdin is not None and sender.stdout is not None
                await sender.stdin.send(b"go\n")
                reply = b""
                while not reply.endswith(b"\n"):  # the line may come in several reads
                    reply += await sender.stdout.receive()
                replies.append(reply.decode())
                window.append(time.monotonic())

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(stream, i)
            tg.start_soon(huge)
    assert replies[0].startswith("400") and "too long" in replies[0], replies
    start, end = window
    before = [g for s in gaps.values() for t, g in s if t < start]
    # every gap between two tokens that overlaps the refusal
    during = [g for s in gaps.values() for t, g in s if t >= start and t - g <= end]
    assert during, "the streams ran while the prompt was refused"
    typical = sorted(before)[len(before) // 2]
    # encoding the prompt in the tokenizer's loop would stall the streams for seconds (1 MB of
    # this text takes ~0.7 s to encode here); a margin of 1 s leaves room for a loaded machine
    assert max(during) < typical + ENCODE_STALL_MARGIN_S, (max(during), typical)


def test_a_client_without_an_engine_fails_fast(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(EngineUnavailableError, match="no pagedserve engine answered"):
        Client(f"ipc://{tmp_path}", connect_timeout_s=1.0)
    assert time.monotonic() - start < 3.0
