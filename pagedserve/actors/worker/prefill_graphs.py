"""A lone request's prompt chunk as its own static step, replayed as CUDA graphs on a GPU.

The chunk that decides a lone request's time to first token (T <= the largest bucket tokens,
nothing else in the step) runs the prefill attention kernel over one query block rather than
T decode rows (static_rows.py), and the model's last layer and the LM head on its last row
only (AttentionMetadata.output_rows). Its inputs are those of the decode step's buffers
(decode_buffers.py, shared: the two never run at once), filled as static rows fill them: rows
0 .. T - 1 are the chunk's tokens, rows T .. size - 1 padding (slot -1: no KV written), and
block-table row 0 the request's. The device derives what the kernels need from them, so the
captured grid covers the padded size while the kernels see the real length:
seq_len = max(seq_lens) (padding rows hold 1), q_len = seq_len - positions[0], the last row
q_len - 1. Padded rows' attention outputs are left unwritten; every later op is row-wise, and
they are dropped before the last layer. The argmax of the last row goes to sampled[0], where
the next step's feed reads it.

Graphs are captured per bucket size (EngineConfig.prefill_graph_sizes up to the longest chunk,
prefill_rows: the decode buffers hold that many rows whatever max_num_seqs is) with
max_query_len = the bucket and max_seq_len = max_model_len, in the decode graphs' memory pool.
Without graphs (the CPU in tests) the same function runs eagerly at the same padded size, with
the host halves of the metadata for the CPU backend.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from pagedserve.actors.worker.cuda_graphs import DecodeStep
from pagedserve.actors.worker.decode_buffers import DecodeFields
from pagedserve.kernels.attention_metadata import AttentionMetadata, OutputRows, cdiv

logger = logging.getLogger(__name__)


def prefill_rows(sizes: Sequence[int], longest_chunk: int) -> int:
    """The decode buffers' rows that the prefill graphs need: their largest size that a chunk
    can use (a chunk holds at most the step's token budget and the model's length)."""
    return max((s for s in sizes if s <= longest_chunk), default=0)


class PrefillStep:
    def __init__(self, decode: DecodeStep, sizes: Sequence[int]) -> None:
        self.model, self.sampled, self.buffers = decode.model, decode.sampled, decode.buffers
        self.max_model_len, self.block_size = decode.max_model_len, decode.block_size
        self.sizes = sorted({s for s in sizes if 1 < s <= decode.buffer_rows})
        self.max_tokens = max(self.sizes, default=0)
        device = decode.device
        self.zero = torch.zeros(1, dtype=torch.int32, device=device)
        self.one_query = torch.tensor([0, 1], dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def padded_size(self, tokens: int) -> int:
        """The bucket a chunk of `tokens` (<= max_tokens) runs at."""
        return min(size for size in self.sizes if size >= tokens)

    def capture(self, pool: object = None) -> None:
        """One graph per bucket, largest first, in `pool` (the decode graphs')."""
        for size in sorted(self.sizes, reverse=True):
            self.forward(size, self.max_model_len)  # warm up: JIT builds
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.forward(size, self.max_model_len)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        logger.info("captured %d prefill graphs (%s tokens)", len(self.graphs), self.sizes)

    def forward(
        self, size: int, max_seq_len: int, host: tuple[int, int, int] | None = None
    ) -> torch.Tensor:
        """Feed, forward (last layer on the last real row), LM head and argmax into sampled[0];
        returns the [1, vocab] logits. host: (tokens, seq_len, width) for the CPU backend."""
        t = self.buffers.tensors
        seq_len = t.seq_lens[:size].amax(0, keepdim=True)  # [1] int32: the request's context
        q_len = seq_len - t.positions[:1].to(torch.int32)
        last = (q_len - 1).to(torch.int64)
        width = cdiv(max_seq_len, self.block_size)
        table = t.block_tables[:1, :width]
        empty = torch.empty(0)
        host_table = empty
        if host is not None:
            host_table = torch.from_numpy(self.buffers.host_views[0].block_tables[:1, :width])
        tokens, context = (host[0], host[1]) if host is not None else (0, 0)

        def metadata(query_start_loc: torch.Tensor, query_len: int, max_query_len: int,
                     slots: torch.Tensor) -> AttentionMetadata:  # fmt: skip
            return AttentionMetadata(
                slot_mapping=slots, query_start_loc=query_start_loc, seq_lens=seq_len,
                block_tables=table, max_query_len=max_query_len, max_seq_len=max_seq_len,
                block_size=self.block_size,
                query_lens_cpu=empty if host is None else torch.tensor([query_len]),
                seq_lens_cpu=empty if host is None else torch.tensor([context]),
                block_tables_cpu=host_table,
            )  # fmt: skip

        chunk = metadata(torch.cat((self.zero, q_len)), tokens, size, t.slot_mapping[:size])
        chunk.output_rows = OutputRows(last, metadata(self.one_query, 1, 1, t.slot_mapping[:1]))
        feed = t.feed_index[:size]
        fed = self.sampled.index_select(0, feed.clamp(min=0))
        input_ids = torch.where(feed >= 0, fed, t.token_ids[:size])
        hidden = self.model(input_ids, t.positions[:size], chunk)
        logits = self.model.compute_logits(hidden)
        self.model.greedy(logits, self.sampled[:1])
        return logits

    def run(self, tokens: int, size: int, seq_len: int) -> torch.Tensor:
        """Upload the staging buffer's rows (filled for `size` rows, block-table row 0) and run
        the chunk: the graph's replay, or the forward eagerly; its [1, vocab] logits."""
        self.buffers.upload(1)
        entry = self.graphs.get(size)
        if entry is None:
            width = cdiv(seq_len, self.block_size)
            return self.forward(size, seq_len, (tokens, seq_len, width))
        graph, logits = entry
        graph.replay()
        return logits


def fill_chunk(
    host: DecodeFields[np.ndarray], block_row: np.ndarray, token_ids: np.ndarray,
    feed_index: np.ndarray, positions: np.ndarray, block_size: int, size: int,
) -> None:  # fmt: skip
    """Rows 0 .. T - 1 the chunk's tokens, T .. size - 1 padding, block-table row 0 the
    request's (block_row: its persistent-batch block table)."""
    tokens = len(positions)
    host.token_ids[:tokens] = token_ids
    host.feed_index[:tokens] = feed_index
    host.positions[:tokens] = positions
    host.slot_mapping[:tokens] = block_row[positions // block_size] * block_size + (
        positions % block_size
    )
    host.seq_lens[:tokens] = positions + 1
    host.pad(tokens, size)
    width = cdiv(int(positions[-1]) + 1, block_size)
    host.block_tables[0, :width] = block_row[:width]
