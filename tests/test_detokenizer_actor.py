"""The detokenizer actor's output step (`on_outputs`) with its sockets replaced by recorders:
routes that replay a request's output after a restart, in the same message as that request's
new tokens, reach the client exactly once, and a replay that ends on a stop string stops the
request at the scheduler."""

from __future__ import annotations

import anyio
import pytest

from pagedserve.actors.detokenizer import DetokenizerActor
from pagedserve.actors.incremental_detokenizer import TokenDecoder
from pagedserve.actors.messages import (
    DeltaBatch,
    EngineOutputs,
    FinishReason,
    RequestOutput,
    Route,
    SamplingParams,
    StopRequests,
)
from pagedserve.config import ASSETS_DIR

CLIENT = b"client-1"


class Recorder:
    """Stands in for a socket: keeps what is sent."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    async def send(self, *args: object) -> None:
        self.sent.append(args[-1])


def detokenizer(decoder: TokenDecoder | None) -> tuple[DetokenizerActor, Recorder, Recorder]:
    actor = DetokenizerActor.__new__(DetokenizerActor)  # no sockets: on_outputs alone
    clients, scheduler = Recorder(), Recorder()
    actor.decoder, actor.streams = decoder, {}
    actor.clients, actor.to_scheduler = clients, scheduler  # type: ignore[assignment]
    return actor, clients, scheduler


def route(handle: int, output: list[int], sampling: SamplingParams | None = None) -> Route:
    sampling = sampling or SamplingParams(max_tokens=16)
    return Route(handle, CLIENT, handle + 100, [5, 6, 7], sampling, output)


def output(handle: int, offset: int, tokens: list[int]) -> RequestOutput:
    return RequestOutput(handle, tokens, None, None, None, 0, offset)


def streamed(clients: Recorder) -> dict[int, list[tuple[int, list[int]]]]:
    """(token offset, tokens) of every delta each request (by seq) got, in order."""
    deltas: dict[int, list[tuple[int, list[int]]]] = {}
    for batch in clients.sent:
        assert isinstance(batch, DeltaBatch)
        for delta in batch.deltas:
            deltas.setdefault(delta.seq, []).append((delta.token_offset, delta.token_ids))
    return deltas


def test_a_replayed_route_and_the_same_steps_output_send_each_token_once() -> None:
    """The route of request 1 was built after its step's token 9 was applied (it holds it);
    request 2's route was built before its step's token (it does not): both streams carry
    every token once, at its offset."""
    actor, clients, _ = detokenizer(None)
    message = EngineOutputs(
        routes=[route(1, [7, 8, 9]), route(2, [3, 4])],
        outputs=[output(1, 2, [9]), output(2, 2, [5])],
    )
    anyio.run(actor.on_outputs, message)
    anyio.run(actor.on_outputs, EngineOutputs(outputs=[output(1, 3, [10]), output(2, 3, [6])]))
    assert streamed(clients) == {
        101: [(0, [7, 8, 9]), (3, [10])],
        102: [(0, [3, 4]), (2, [5]), (3, [6])],
    }


def test_output_of_several_tokens_overlapping_a_route_sends_only_the_new_ones() -> None:
    """A speculative step's output of three tokens, the first two already in the route."""
    actor, clients, _ = detokenizer(None)
    message = EngineOutputs(routes=[route(1, [7, 8, 9])], outputs=[output(1, 1, [8, 9, 11])])
    anyio.run(actor.on_outputs, message)
    assert streamed(clients) == {101: [(0, [7, 8, 9]), (3, [11])]}


@pytest.fixture(scope="module")
def decoder() -> TokenDecoder:
    return TokenDecoder.load(str(ASSETS_DIR / "tiny-shakespeare"))


def test_a_replay_that_ends_on_a_stop_string_stops_the_request_at_the_scheduler(
    decoder: TokenDecoder,
) -> None:
    """A detokenizer that died before telling the scheduler of a stop string: its successor
    finds the stop string in the replayed output, ends the client's stream there and tells the
    scheduler to stop computing the request."""
    tokens = decoder.tokenizer.encode("To be, or not to be: that is the question").ids
    stop_at = decoder.tokenizer.encode(" that").ids
    sampling = SamplingParams(max_tokens=64, stop=["that"])
    actor, clients, scheduler = detokenizer(decoder)
    anyio.run(actor.on_outputs, EngineOutputs(routes=[route(1, tokens, sampling)]))
    (batch,) = clients.sent
    assert isinstance(batch, DeltaBatch)
    (delta,) = batch.deltas
    assert delta.finish_reason is FinishReason.STOP and delta.stop_reason == "that"
    assert "that" not in delta.text and delta.text.startswith("To be")
    assert len(delta.token_ids) < len(tokens) and stop_at[-1] in delta.token_ids
    assert scheduler.sent == [StopRequests([1])]
    assert actor.streams == {}


def test_a_finished_requests_route_and_its_last_output_end_the_stream_once() -> None:
    """The step's result finished the request, then its resubmission in the same batch got
    the final route (every token, how it ended): one final delta, the output adds nothing."""
    actor, clients, _ = detokenizer(None)
    final = Route(1, CLIENT, 101, [5, 6, 7], SamplingParams(max_tokens=3), [7, 8, 9],
                  FinishReason.LENGTH)  # fmt: skip
    last = RequestOutput(1, [9], None, FinishReason.LENGTH, None, 0, 2)
    anyio.run(actor.on_outputs, EngineOutputs(routes=[final], outputs=[last]))
    (batch,) = clients.sent
    assert isinstance(batch, DeltaBatch)
    (delta,) = batch.deltas
    assert delta.token_ids == [7, 8, 9] and delta.finish_reason is FinishReason.LENGTH
    assert actor.streams == {}
