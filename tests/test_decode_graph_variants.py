"""The decode graphs' LoRA variants (worker/cuda_graphs.py): with adapters, a step in which no
request has one replays the graph captured without the LoRA kernels, and any other step the
one with them; eagerly, such a step runs its forward with the adapters switched off. The
graphs themselves need a GPU: stand-ins record which one ran."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from pagedserve.actors.worker.cuda_graphs import DecodeStep


class FakeGraph:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def replay(self) -> None:
        self.log.append(self.name)


class Adapters:
    def __init__(self) -> None:
        self.step_adapted = False
        self.off = False

    @contextlib.contextmanager
    def without_adapters(self) -> Iterator[None]:
        self.off = True
        try:
            yield
        finally:
            self.off = False


def test_steps_without_adapters_take_the_graphs_without_lora() -> None:
    adapters, log = Adapters(), []
    step = DecodeStep(None, torch.zeros(8, dtype=torch.long), 8, 64, 16, adapters=adapters)  # type: ignore[arg-type]
    with_lora, without = torch.zeros(4, 3), torch.ones(4, 3)
    step.graphs[4] = (FakeGraph(log, "lora"), with_lora)  # type: ignore[assignment]
    step.graphs_without_adapters[4] = (FakeGraph(log, "plain"), without)  # type: ignore[assignment]
    assert step.replay(4, 64, None) is without
    adapters.step_adapted = True
    assert step.replay(4, 64, None) is with_lora
    adapters.step_adapted = False
    assert step.replay(4, 64, None) is without
    assert log == ["plain", "lora", "plain"]


def test_an_eager_step_without_adapters_runs_with_them_off() -> None:
    adapters = Adapters()
    seen: list[bool] = []
    step = DecodeStep(None, torch.zeros(8, dtype=torch.long), 8, 64, 16, adapters=adapters)  # type: ignore[arg-type]
    step.forward = lambda size, metadata: seen.append(adapters.off) or torch.zeros(size)  # type: ignore[method-assign]
    step.replay(2, 64, None)
    adapters.step_adapted = True
    step.replay(2, 64, None)
    assert seen == [True, False] and not adapters.off
