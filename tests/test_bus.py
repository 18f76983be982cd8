"""The wire: every message round-trips through the codec; malformed frames are rejected."""

from __future__ import annotations

import logging
import time

import anyio
import msgspec
import pytest
import zmq
import zmq.asyncio

from pagedserve.actors import bus
from pagedserve.actors import messages as m
from pagedserve.actors import supervision_messages as sm
from pagedserve.config import BUS_SPIN_US, SPIN_MIN_CPUS, EngineConfig, default_bus_spin_us

SAMPLING = m.SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=["\n"], logprobs=2)
LOGPROBS = m.TokenLogprobs(7, -0.5, 1, [7, 8], [-0.5, -1.5])

EXAMPLES: list[msgspec.Struct] = [
    m.GenerateRequest(seq=1, sampling=SAMPLING, prompt="hi"),
    m.GenerateRequest(
        seq=2,
        sampling=m.SamplingParams(),
        messages=[m.ChatMessage("user", "hi")],
        resume_token_ids=[4, 5],
    ),  # fmt: skip
    m.AbortRequest(seqs=[1, 2], client=b"c"),
    m.StatsRequest(seq=3),
    m.Hello(),
    m.Ping(),
    m.Welcome(2),
    m.Pong(3),
    m.DeltaBatch(
        [
            m.RequestDelta(
                seq=1,
                text="é",
                token_ids=[1],
                logprobs=[LOGPROBS],
                finish_reason=m.FinishReason.STOP,
                stop_reason="\n",
                prompt_token_ids=[1, 2],
                num_cached_tokens=16,
                token_offset=4,
                text_offset=9,
            ),
            m.RequestDelta(seq=2, text="x", token_ids=[3]),
        ]
    ),
    m.RequestError(seq=1, message="bad", status_code=400),
    m.AddRequest(
        client=b"c", seq=1, prompt_token_ids=[1, 2, 3], sampling=SAMPLING, eos_token_ids=[0]
    ),
    m.StopRequests([7]),
    m.EngineOutputs(
        routes=[m.Route(7, b"c", 1, [1, 2], SAMPLING, [5], m.FinishReason.LENGTH, None)],
        outputs=[m.RequestOutput(7, [5], [LOGPROBS], m.FinishReason.LENGTH, None, 0, 0)],
        errors=[m.RequestError(seq=2, message="too long", client=b"c")],
    ),
    m.SchedulerStats(seq=3, client=b"c", num_running=2, num_free_blocks=9),
    m.EpochChanged(4, drop_handles_below=4 << m.EPOCH_SHIFT),
    m.EngineFailed("the worker could not be restarted"),
    m.WorkersLost(5),
    m.WorkersReady(6),
    m.StepPlan(
        step_id=4,
        new_requests=[m.NewRequestData(7, [1, 2, 3], 2, SAMPLING, 99, [0, 5], 0)],
        cached_requests=m.CachedRequestData([33], [1], [7]),
        scheduled=[8, 7],
        num_scheduled_tokens=[1, 3],
        finished=[9],
        reset=True,
    ),
    m.StepResult(step_id=4, handles=[7], sampled_token_ids=[9], logprobs=[None]),
    m.Shutdown("bye"),
    m.ActorReady(name="worker", pid=1, num_kv_blocks=100),
    m.ActorFailed("worker", "boom", pid=1),
    sm.Heartbeat(
        sm.ActorStats(
            name="worker",
            pid=1,
            epoch=2,
            uptime_s=3.0,
            busy_s=1.0,
            cpu_s=2.0,
            rss_bytes=9,
            messages_in=4,
            messages_out=5,
            rejected=1,
            queues={"batch": 3},
            stalled_s=0.5,
            blocking="step",
        )
    ),  # fmt: skip
    sm.StatusRequest(),
    sm.EngineStatus(epoch=3, actors=[sm.ActorStatus(label="worker", state="running", restarts=2)]),
]

CHANNEL_OF = {
    m.GenerateRequest: m.ClientRequests,
    m.AbortRequest: m.SchedulerInbound,
    m.StatsRequest: m.ClientRequests,
    m.Hello: m.ClientControl,
    m.Ping: m.ClientControl,
    m.Welcome: m.ClientOutbound,
    m.Pong: m.ClientOutbound,
    m.DeltaBatch: m.ClientOutbound,
    m.RequestError: m.ClientOutbound,
    m.AddRequest: m.SchedulerInbound,
    m.StopRequests: m.SchedulerInbound,
    m.EngineOutputs: m.DetokenizerInbound,
    m.SchedulerStats: m.DetokenizerInbound,
    m.EpochChanged: m.DetokenizerInbound,
    m.EngineFailed: m.DetokenizerInbound,
    m.WorkersLost: m.SchedulerInbound,
    m.WorkersReady: m.SchedulerInbound,
    m.StepPlan: m.WorkerInbound,
    m.StepResult: m.SchedulerInbound,
    m.Shutdown: m.WorkerInbound,
    m.ActorReady: sm.SupervisorInbound,
    m.ActorFailed: sm.SupervisorInbound,
    sm.Heartbeat: sm.SupervisorInbound,
    sm.StatusRequest: sm.StatusRequest,
    sm.EngineStatus: sm.EngineStatus,
}


def tagged_messages() -> set[type]:
    """Every top-level message of the schema (the tagged Structs)."""
    return {
        value
        for value in [*vars(m).values(), *vars(sm).values()]
        if isinstance(value, type)
        and issubclass(value, msgspec.Struct)
        and value.__struct_config__.tag is not None
    }


def test_examples_cover_every_message_type() -> None:
    assert {type(e) for e in EXAMPLES} == tagged_messages() == set(CHANNEL_OF)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda e: type(e).__name__)
def test_every_message_round_trips_through_its_channel_codec(message: msgspec.Struct) -> None:
    codec: bus.Codec = bus.Codec(CHANNEL_OF[type(message)], "test")
    assert codec.decode(bus.encode(message)) == message


def test_a_message_of_another_channel_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    codec: bus.Codec = bus.Codec(m.WorkerInbound, "worker")
    with caplog.at_level(logging.ERROR):
        assert codec.decode(bus.encode(m.AbortRequest(seqs=[1]))) is None
    assert codec.num_rejected == 1
    assert "rejected a malformed frame" in caplog.text


def test_invalid_field_values_are_rejected_by_validation() -> None:
    frame = msgspec.msgpack.encode(
        {"type": "GenerateRequest", "seq": 1, "sampling": {"temperature": -1.0}}
    )
    codec: bus.Codec = bus.Codec(m.ClientRequests, "client")
    assert codec.decode(frame) is None


async def test_receiver_logs_garbage_and_keeps_receiving(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    address = f"ipc://{tmp_path}/inbox.sock"
    ctx = zmq.asyncio.Context()
    receiver: bus.Receiver = bus.Receiver(ctx, address, m.SchedulerInbound)
    push = ctx.socket(zmq.PUSH)
    push.connect(address)
    try:
        with caplog.at_level(logging.ERROR):
            await push.send(b"\xc1 not msgpack")
            await push.send(msgspec.msgpack.encode({"type": "NoSuchMessage"}))
            await push.send(bus.encode(m.AbortRequest(seqs=[5])))
            with anyio.fail_after(5):
                received = await receiver.recv()
        assert received == m.AbortRequest(seqs=[5])
        assert receiver.codec.num_rejected == 2
        assert caplog.text.count("rejected a malformed frame") == 2
    finally:
        push.close(0)
        receiver.close()
        ctx.term()


def test_sampling_params_validate_like_vllm() -> None:
    for bad in (
        dict(n=0),
        dict(temperature=-0.1),
        dict(top_p=0.0),
        dict(max_tokens=0),
        dict(min_p=1.5),
        dict(top_k=-2),
        dict(logprobs=-1),
    ):
        with pytest.raises(ValueError):
            m.SamplingParams(**bad)
    assert m.SamplingParams(stop="x").stop == ["x"]
    assert m.SamplingParams(top_k=-1).top_k == 0


async def test_frames_sent_before_a_peer_connects_arrive_in_order(tmp_path) -> None:
    """A bound sender with no peer yet holds its frames (on the loop) and delivers them, in
    the order sent, once one connects; a later send does not overtake a waiting one."""
    address = f"ipc://{tmp_path}/plans.sock"
    ctx = zmq.asyncio.Context()
    sender: bus.Sender = bus.Sender(ctx, address, bind=True)
    receiver: bus.Receiver | None = None
    try:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, m.AbortRequest(seqs=[1]))
                await anyio.sleep(0.05)
                tg.start_soon(sender.send, m.AbortRequest(seqs=[2]))
                await anyio.sleep(0.05)
                receiver = bus.Receiver(ctx, address, m.SchedulerInbound, bind=False)
            await sender.send(m.AbortRequest(seqs=[3]))
            received = [await receiver.recv() for _ in range(3)]
        assert [r.seqs for r in received] == [[1], [2], [3]]
        assert receiver.recv_ready() == [] and not receiver.has_ready()
    finally:
        sender.close()
        if receiver is not None:
            receiver.close()
        ctx.term()


@pytest.mark.parametrize("spin_s", [0.0, 0.005])
async def test_a_receiver_that_polls_first_still_lets_the_loop_run(tmp_path, spin_s) -> None:
    """poll_first_s (after spinning for spin_s): frames that come during the poll or long
    after it arrive in order, and while it waits beyond the poll the loop runs other tasks."""
    address = f"ipc://{tmp_path}/inbox.sock"
    ctx = zmq.asyncio.Context()
    receiver: bus.Receiver = bus.Receiver(
        ctx, address, m.SchedulerInbound, poll_first_s=0.01, spin_s=spin_s
    )
    sender: bus.Sender = bus.Sender(ctx, address)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0.01)

    async def send_later() -> None:
        await sender.send(m.AbortRequest(seqs=[1]))
        await anyio.sleep(0.3)  # far past the poll: the receiver waits on the loop
        await sender.send(m.AbortRequest(seqs=[2]))
        await sender.send(m.AbortRequest(seqs=[3]))

    try:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(tick)
                tg.start_soon(send_later)
                received = [await receiver.recv() for _ in range(3)]
                tg.cancel_scope.cancel()
        assert [r.seqs for r in received] == [[1], [2], [3]]
        assert ticks >= 10  # the ticker ran all along the 0.3 s wait
    finally:
        sender.close()
        receiver.close()
        ctx.term()


async def test_frames_for_another_socket_are_served_during_the_poll(tmp_path) -> None:
    """meanwhile: while an inbox polls (here up to 10 s), frames on another socket of the loop
    are served as they come, not after the poll, whether or not another task waits on that
    socket; the inbox still gets its own frame."""
    inbox_address, other_address = f"ipc://{tmp_path}/inbox.sock", f"ipc://{tmp_path}/other.sock"
    ctx = zmq.asyncio.Context()
    other = bus.Receiver(ctx, other_address, m.SchedulerInbound)
    to_inbox: bus.Sender = bus.Sender(ctx, inbox_address)
    to_other: bus.Sender = bus.Sender(ctx, other_address)
    served: list[tuple[int, float]] = []

    async def serve(message: m.AbortRequest) -> None:
        served.append((message.seqs[0], time.monotonic() - start))
        if len(served) == 2:
            await to_inbox.send(m.AbortRequest(seqs=[0]))

    async def serve_queued() -> None:
        for message in other.recv_ready():
            await serve(message)

    async def task_waiting_on_other() -> None:
        while True:
            await serve(await other.recv())

    receiver: bus.Receiver = bus.Receiver(
        ctx, inbox_address, m.SchedulerInbound, poll_first_s=10.0,
        meanwhile=(other.socket, serve_queued),
    )  # fmt: skip
    try:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(task_waiting_on_other)
                await anyio.sleep(0.05)  # it waits on the loop for `other`
                start = time.monotonic()
                await to_other.send(m.AbortRequest(seqs=[1]))
                await to_other.send(m.AbortRequest(seqs=[2]))
                received = await receiver.recv()
                tg.cancel_scope.cancel()
        assert received.seqs == [0]
        assert [seq for seq, _ in served] == [1, 2]
        assert max(after for _, after in served) < 1.0  # not after the 10 s poll
    finally:
        for channel in (other, receiver, to_inbox, to_other):
            channel.close()
        ctx.term()


async def test_a_router_told_not_to_poll_leaves_the_loop_free(tmp_path) -> None:
    """Router.recv(poll_first=False) waits on the loop at once: another task (the tokenizer's
    off-loop encode handing on its result) runs while it waits, whatever poll_first_s is."""
    address = f"ipc://{tmp_path}/requests.sock"
    ctx = zmq.asyncio.Context()
    router: bus.Router = bus.Router(ctx, address, m.ClientRequests, poll_first_s=10.0)
    dealer = bus.dealer_socket(ctx, address, b"client-1")
    ran_after: list[float] = []

    async def other_task() -> None:
        await anyio.sleep(0.01)
        ran_after.append(time.monotonic() - start)
        await dealer.send(bus.encode(m.AbortRequest(seqs=[7])))

    try:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                start = time.monotonic()
                tg.start_soon(other_task)
                identity, message = await router.recv(poll_first=False)
        assert (identity, message.seqs) == (b"client-1", [7])
        assert ran_after[0] < 1.0
    finally:
        dealer.close(linger=0)
        router.close()
        ctx.term()


def test_inboxes_spin_on_gpu_machines_with_cores_to_spare_or_as_configured() -> None:
    """EngineConfig.bus_spin_us: unset, BUS_SPIN_US for a GPU engine on a machine of at least
    SPIN_MIN_CPUS CPUs, else none (a CPU worker needs the cores; on 2 CPUs spinning starves
    ZeroMQ's I/O threads); resolve() keeps a value that was set and fills in the default."""
    assert default_bus_spin_us("cuda", SPIN_MIN_CPUS) == BUS_SPIN_US
    assert default_bus_spin_us("cuda", SPIN_MIN_CPUS - 1) == 0
    assert default_bus_spin_us("cpu", 64) == 0
    assert EngineConfig(device="cpu").resolve().bus_spin_us == 0
    resolved = EngineConfig(device="cpu", bus_spin_us=250).resolve()
    assert resolved.spin_seconds == pytest.approx(250e-6)
    with pytest.raises(ValueError, match="bus_spin_us"):
        EngineConfig(bus_spin_us=-1)
