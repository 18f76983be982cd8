"""Decode steps through static buffers, replayed as CUDA graphs on a GPU.

A decode step (one token per request, every request samples) reads its inputs from
DecodeBuffers and runs one function: take the tokens the previous step sampled (still on the
device, in `sampled`) where the host does not know them yet, the model's forward, the LM head,
and the greedy argmax written back into `sampled`. On a GPU that function is captured once per
batch size in capture_sizes (up to its max_batch: max_num_seqs, or with speculative decoding
max_num_seqs * (1 + k), a verify step's rows) and a step of batch B replays the smallest
captured size >= B with padded rows, so the host's work per step is one input copy, one graph
launch and one copy of the sampled ids back. Padded rows write no KV (slot -1), attend one key
of an old block, and their outputs are dropped. Rows that sample other than greedily take the
returned logits to the sampler, which writes its tokens into `sampled`.

With LoRA adapters (`adapters`), each size is captured twice: with the LoRA kernels, and
without them (`without_adapters`) for the steps in which no request has an adapter, which then
launch nothing for LoRA (on an H100, batch-1 Qwen3-0.6B decode paid ~0.5 ms a step for 224
LoRA launches that found no token).

The attention kernels size their decode splits from `max_seq_len`, a host int, so graphs are
captured with the model's max_model_len: captured grids cover any context. Without graphs (the
CPU, enforce_eager, a failed capture) the same function runs eagerly at the step's own batch
size, with max_seq_len from the step.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Protocol

import numpy as np
import torch

from pagedserve.actors.worker.decode_buffers import DecodeBuffers, DecodeFields
from pagedserve.kernels.attention_metadata import AttentionMetadata, cdiv

logger = logging.getLogger(__name__)


class CausalLM(Protocol):
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def greedy(self, logits: torch.Tensor, out: torch.Tensor) -> None: ...


class AdapterSwitch(Protocol):
    """The LoRA adapters as the decode graphs see them (worker.lora_slots.LoRASlots)."""

    step_adapted: bool  # whether any token of the step about to run has an adapter

    def without_adapters(self) -> contextlib.AbstractContextManager[None]: ...


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes with a graph (17 up to 256, 25 up to 1024: each one costs start-up time to
    capture). A decode step pads up to the next size; padded rows are cheap (they attend one
    key and decode is bound by reading weights and K/V), at most 45% extra rows at batch 33
    and under 25% from 64 up."""
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]
    sizes += [320, 384, 448, 512, 640, 768, 896, 1024]
    return [s for s in sizes if s < max_batch] + [max_batch]


class DecodeStep:
    def __init__(
        self,
        model: CausalLM,
        sampled: torch.Tensor,
        max_batch: int,
        max_model_len: int,
        block_size: int,
        buffer_rows: int = 0,
        adapters: AdapterSwitch | None = None,
    ) -> None:
        """sampled: [>= max_batch] int64 on the device, the runner's buffer of the last step's
        sampled ids (read by this step's feed, written by its argmax). buffer_rows: rows of
        the input buffers beyond max_batch, for the prefill graphs that share them. adapters:
        the LoRA adapters, whose steps without any take graphs without their kernels."""
        self.model, self.sampled = model, sampled
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.block_size = block_size
        self.device = sampled.device
        self.buffer_rows = max(max_batch, buffer_rows)
        max_blocks = cdiv(max_model_len + 1, block_size)
        self.buffers = DecodeBuffers(self.buffer_rows, max_blocks, self.device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=self.device)
        self.query_lens_cpu = torch.ones(max_batch, dtype=torch.int64)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.adapters = adapters
        # the same sizes captured without the LoRA kernels (only with adapters)
        self.graphs_without_adapters: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: object = None  # the graphs' memory pool (the prefill graphs share it)

    def padded_size(self, batch: int) -> int:
        """The batch a step of `batch` rows runs at: the smallest captured size that holds it."""
        if not self.graphs:
            return batch
        return min(size for size in self.graphs if size >= batch)

    def capture(self) -> None:
        """One graph per size in capture_sizes, largest first, so that the smaller graphs reuse
        its memory pool. Captures with padding inputs (the buffers' initial contents)."""
        pool = None
        for index, size in enumerate(sorted(capture_sizes(self.max_batch), reverse=True)):
            metadata = self.metadata(size, self.max_model_len)
            for _ in range(2 if index == 0 else 1):  # warm up: JIT builds, lazy initialisation
                self.forward(size, metadata)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.forward(size, metadata)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = (graph, logits)
            if self.adapters is not None:
                with self.adapters.without_adapters():
                    plain = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(plain, pool=pool):
                        logits = self.forward(size, metadata)
                self.graphs_without_adapters[size] = (plain, logits)
        self.pool = pool
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode graphs (batch 1..%d)", len(self.graphs), self.max_batch)

    def metadata(
        self, size: int, max_seq_len: int, host: DecodeFields[np.ndarray] | None = None
    ) -> AttentionMetadata:
        """Attention metadata over the first `size` rows of the device buffers; its host
        halves (which the CPU reference backend reads) from `host`, the staging views."""
        t = self.buffers.tensors
        width = cdiv(max_seq_len, self.block_size)
        empty = torch.empty(0)
        return AttentionMetadata(
            slot_mapping=t.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=t.seq_lens[:size],
            block_tables=t.block_tables[:size, :width],
            max_query_len=1,
            max_seq_len=max_seq_len,
            block_size=self.block_size,
            query_lens_cpu=empty if host is None else self.query_lens_cpu[:size],
            seq_lens_cpu=empty if host is None else torch.from_numpy(host.seq_lens[:size]),
            block_tables_cpu=empty if host is None
            else torch.from_numpy(host.block_tables[:size, :width]),
        )  # fmt: skip

    def input_ids(self, size: int) -> torch.Tensor:
        """The first `size` rows' tokens: the host's, or fed from the previous step's samples."""
        t = self.buffers.tensors
        feed = t.feed_index[:size]
        fed = self.sampled.index_select(0, feed.clamp(min=0))
        return torch.where(feed >= 0, fed, t.token_ids[:size])

    def forward(self, size: int, metadata: AttentionMetadata) -> torch.Tensor:
        """Feed, forward, LM head and argmax over the first `size` rows; returns the logits."""
        hidden = self.model(self.input_ids(size), self.buffers.tensors.positions[:size], metadata)
        logits = self.model.compute_logits(hidden)
        self.model.greedy(logits, self.sampled[:size])
        return logits

    def run(
        self, batch: int, size: int, max_seq_len: int, host: DecodeFields[np.ndarray]
    ) -> torch.Tensor | None:
        """Upload `host` (the staging views, filled for `size` rows, `size` from padded_size)
        and run the step; returns the batch rows' logits (valid until the next step) and leaves
        their argmax in sampled[:batch]."""
        return self.execute(size, max_seq_len, host)[:batch]

    def execute(self, size: int, max_seq_len: int, host: DecodeFields[np.ndarray]) -> torch.Tensor:
        """Upload and run `size` rows: the graph's replay, or the forward eagerly; its output."""
        self.buffers.upload(size)
        return self.replay(size, max_seq_len, host)

    def replay(
        self, size: int, max_seq_len: int, host: DecodeFields[np.ndarray] | None
    ) -> torch.Tensor:
        """Run `size` rows from the device buffers as they are (written there by the host's
        upload or by kernels): the graph's replay, or the forward eagerly, whose CPU backend
        reads the host views `host` of the same rows; its output."""
        unadapted = self.adapters is not None and not self.adapters.step_adapted
        graphs = self.graphs_without_adapters if unadapted else self.graphs
        entry = graphs.get(size)
        if entry is None:
            scope = self.adapters.without_adapters() if unadapted else contextlib.nullcontext()
            with scope:  # type: ignore[union-attr]
                return self.forward(size, self.metadata(size, max_seq_len, host))
        graph, output = entry
        graph.replay()
        return output
