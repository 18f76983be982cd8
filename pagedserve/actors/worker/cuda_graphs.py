"""CUDA graphs for decode steps: the model's forward captured once per batch size in
CAPTURE_SIZES (up to max_num_seqs), a decode step of batch B replays the smallest captured size
>= B with padded inputs.

The graphs read their inputs from static buffers (token ids, positions, KV slots, block tables,
context lengths); `run` copies a step's inputs into them and replays. Padded rows write no KV
(slot -1), attend one key of block 0, and their outputs are dropped. The attention kernels
size their decode splits from `max_seq_len`, a host int, so graphs are captured with the
model's max_model_len: captured grids cover any context.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pagedserve.kernels.attention import AttentionMetadata

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes with a graph (17 up to 256, 25 up to 1024: each one costs start-up time to
    capture). A decode step pads up to the next size; padded rows are cheap (they attend one
    key and decode is bound by reading weights and K/V), at most 45% extra rows at batch 33
    and under 25% from 64 up."""
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]
    sizes += [320, 384, 448, 512, 640, 768, 896, 1024]
    return [s for s in sizes if s < max_batch] + [max_batch]


class DecodeGraphs:
    def __init__(
        self,
        forward: Forward,
        max_batch: int,
        max_blocks: int,
        max_model_len: int,
        block_size: int,
        backend: str,
        device: torch.device,
    ) -> None:
        self.forward = forward
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.backend = backend
        self.device = device
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def metadata(self, batch: int) -> AttentionMetadata:
        empty = torch.empty(0)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
            query_lens_cpu=empty,
            seq_lens_cpu=empty,
            block_tables_cpu=empty,
            backend=self.backend,
        )

    def capture(self) -> None:
        """Largest size first, so smaller graphs reuse its memory pool."""
        for index, size in enumerate(sorted(capture_sizes(self.max_batch), reverse=True)):
            args = (self.input_ids[:size], self.positions[:size], self.metadata(size))
            for _ in range(2 if index == 0 else 1):  # warm up: JIT builds, lazy initialisation
                self.forward(*args)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                output = self.forward(*args)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = (graph, output)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode graphs (batch 1..%d)", len(self.graphs), self.max_batch)

    def can_run(self, metadata: AttentionMetadata) -> bool:
        batch = metadata.seq_lens.shape[0]
        return bool(self.graphs) and metadata.max_query_len == 1 and batch <= self.max_batch

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        batch = input_ids.shape[0]
        size = min(s for s in self.graphs if s >= batch)
        graph, output = self.graphs[size]
        width = metadata.block_tables.shape[1]
        self.input_ids[:batch].copy_(input_ids, non_blocking=True)
        self.positions[:batch].copy_(positions, non_blocking=True)
        self.slot_mapping[:batch].copy_(metadata.slot_mapping, non_blocking=True)
        self.slot_mapping[batch:size].fill_(-1)
        self.block_tables[:batch, :width].copy_(metadata.block_tables, non_blocking=True)
        self.seq_lens[:batch].copy_(metadata.seq_lens, non_blocking=True)
        self.seq_lens[batch:size].fill_(1)
        graph.replay()
        return output[:batch]
