"""A worker that is one pipeline stage: activations in from the previous stage, out to the next.

Every stage runs every plan, in plan order, on its own persistent batch (the scheduler's block
tables are shared by all stages; each stage owns the KV cache of its own layers) and builds the
same step inputs. A stage after the first receives the hidden states and residuals of the
step's tokens from the same tensor-parallel rank of the previous stage (point to point, in
the worker process group: NCCL or gloo); a stage before the last sends its own to the next.
Only the last stage computes logits and samples; the stages never wait for each other
otherwise, so on a GPU a stage queues its next step while the next stage runs this one.

`StageLink` is that transfer. Before start-up ends (`connect`), it is offline: receives give
zeros and sends do nothing, so that the start-up's synthetic steps (memory profiling,
warm-up, graph capture) run on each stage alone.

`StageDecodeStep` is the static decode path of one stage (cuda_graphs.DecodeStep): the
captured forward of a stage after the first reads its activations from static input buffers
(the transfer writes their first rows before the replay), and that of a stage before the last
returns its activations, stacked [2, rows, hidden], for the transfer after it. Transfers carry
exactly the batch's rows, so stages agree whatever batch sizes they captured.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from pagedserve.actors.worker.cuda_graphs import CausalLM, DecodeStep
from pagedserve.actors.worker.decode_buffers import DecodeFields
from pagedserve.actors.worker.parallel_groups import WorkerGroups
from pagedserve.kernels.attention_metadata import AttentionMetadata
from pagedserve.models.stages import StageActivations


class StageLink:
    def __init__(
        self, groups: WorkerGroups, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.stage = stage = groups.stage
        tp = groups.layout.tensor_parallel_size
        self.previous = None if stage.is_first else groups.rank - tp
        self.next = None if stage.is_last else groups.rank + tp
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.connected = False

    @classmethod
    def of(
        cls, groups: WorkerGroups | None, model: torch.nn.Module, device: torch.device
    ) -> StageLink | None:
        """The link of a pipeline stage's model; None without pipeline parallelism."""
        if groups is None or groups.layout.pipeline_parallel_size == 1:
            return None
        dtype = next(model.parameters()).dtype
        return cls(groups, int(model.config.hidden_size), dtype, device)  # type: ignore[union-attr]

    def connect(self) -> None:
        """Start-up is over: transfers are real from now on. Every rank of the engine calls
        this once: a barrier of the whole group (which NCCL initialises collectively) before
        any transfer."""
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        dist.barrier(device_ids=device_ids)
        self.connected = True

    def receive(self, num_tokens: int) -> StageActivations:
        shape = (num_tokens, self.hidden_size)
        received = StageActivations(
            torch.empty(shape, dtype=self.dtype, device=self.device),
            torch.empty(shape, dtype=self.dtype, device=self.device),
        )
        self.receive_into(received)
        return received

    def receive_into(self, received: StageActivations) -> None:
        """The previous stage's activations of this step into `received` (contiguous)."""
        if not self.connected:
            received.hidden.zero_()
            received.residual.zero_()
            return
        assert self.previous is not None, "the first stage receives nothing"
        self._exchange(dist.irecv, received, self.previous)

    def send(self, activations: StageActivations) -> None:
        if not self.connected:
            return
        assert self.next is not None, "the last stage sends nothing"
        outgoing = StageActivations(
            activations.hidden.contiguous(), activations.residual.contiguous()
        )
        self._exchange(dist.isend, outgoing, self.next)

    @staticmethod
    def _exchange(
        operation: Callable[[torch.Tensor, int], dist.Work | None],
        activations: StageActivations,
        peer: int,
    ) -> None:
        """Hidden states, then residuals; on a GPU the waits order the stream, not the host."""
        works = [operation(t, peer) for t in (activations.hidden, activations.residual)]
        for work in works:
            assert work is not None  # isend and irecv on a rank of the group
            work.wait()


def run_stage(
    model: CausalLM,
    link: StageLink | None,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    metadata: AttentionMetadata,
) -> torch.Tensor | None:
    """The model over a step's tokens: the final hidden states, or None at a stage before
    the last (its activations went to the next stage)."""
    if link is None:
        return model(input_ids, positions, metadata)
    received = None if link.stage.is_first else link.receive(len(positions))
    output = model(input_ids, positions, metadata, received)  # type: ignore[call-arg]
    if link.stage.is_last:
        return output
    link.send(output)
    return None


class StageDecodeStep(DecodeStep):
    def __init__(
        self,
        model: CausalLM,
        sampled: torch.Tensor,
        max_batch: int,
        max_model_len: int,
        block_size: int,
        link: StageLink,
    ) -> None:
        super().__init__(model, sampled, max_batch, max_model_len, block_size)
        self.link, self.stage = link, link.stage
        shape = (max_batch, link.hidden_size)
        self.received = StageActivations(
            torch.zeros(shape, dtype=link.dtype, device=self.device),
            torch.zeros(shape, dtype=link.dtype, device=self.device),
        )

    def forward(self, size: int, metadata: AttentionMetadata) -> torch.Tensor:
        """The last stage's: logits (argmax into `sampled`); the others': [2, size, hidden]."""
        received = None
        if not self.stage.is_first:
            received = StageActivations(self.received.hidden[:size], self.received.residual[:size])
        positions = self.buffers.tensors.positions[:size]
        output = self.model(self.input_ids(size), positions, metadata, received)  # type: ignore[call-arg]
        if not self.stage.is_last:
            return torch.stack((output.hidden, output.residual))
        logits = self.model.compute_logits(output)
        self.model.greedy(logits, self.sampled[:size])
        return logits

    def run(
        self, batch: int, size: int, max_seq_len: int, host: DecodeFields[np.ndarray]
    ) -> torch.Tensor | None:
        """Receive, run, send: the batch rows' logits at the last stage, else None."""
        if not self.stage.is_first:
            rows = StageActivations(self.received.hidden[:batch], self.received.residual[:batch])
            self.link.receive_into(rows)
        output = self.execute(size, max_seq_len, host)
        if self.stage.is_last:
            return output[:batch]
        self.link.send(StageActivations(output[0, :batch], output[1, :batch]))
        return None
