"""A draft model's k greedy decodes in one go on the device: one CUDA graph per batch size.

After a step, each request's draft KV lacks at most its last two tokens (a fully accepted
step's last draft, which the draft never read, and the target's new token), so the chain
starts with a pair step (2 rows per request: positions P - 1 and P, P the position of the
request's last token) whose second row's argmax is the first draft; then k - 1 steps of one
row per request, each fed the previous step's argmax at the next position. Every input is
computed on the device from a small start record per request (ChainStart: P, the tokens at
P - 1 and P, its blocks), so the k decodes need no host work between them, and a GPU replays
them as one graph. Rows past a request's blocks write no KV (slot -1) and attend only keys
inside them; positions past the model's length are clamped (their drafts are never used: the
scheduler verifies no token past max_model_len).

The start record comes from the host (`stage`, any step), or, after a verify step that ran as
a decode step, from the device (`start_after_verify`): a request's accepted drafts are the
longest prefix equal to the target's samples at their rows, so P and both tokens follow from
the verify's inputs and samples without a host round trip. Static buffers are shared by both
ways and by the CPU (where the chain runs eagerly), so the CPU tests run the same code. On a
GPU the start from the verify is captured with the chain (a second graph per size): its
gathers and compares would otherwise be ~16 eager launches per step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.actors.worker.cuda_graphs import DecodeStep, capture_sizes
from pagedserve.actors.worker.uploader import PinnedStaging
from pagedserve.kernels.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# per-request int64 fields of the start record, in the staging buffer's order
START_FIELDS = ("last_pos", "prev_token", "last_token", "num_blocks", "verify_row", "num_drafts")


@dataclass
class StartViews:
    """One [max_seqs] view per START_FIELDS entry and the block tables [max_seqs, max_blocks]
    (numpy views of a staging buffer, or tensors of the device buffer)."""

    fields: dict[str, np.ndarray | torch.Tensor]
    tables: np.ndarray | torch.Tensor


class ChainStart:
    """The chain's per-request start record: a pinned staging buffer sent with one copy to a
    device buffer of the same layout (on the CPU, one buffer)."""

    def __init__(self, max_seqs: int, max_blocks: int, device: torch.device) -> None:
        self.max_seqs, self.max_blocks = max_seqs, max_blocks
        self.int_bytes = len(START_FIELDS) * max_seqs * 8
        nbytes = self.int_bytes + max_seqs * max_blocks * 4
        self.pinned: PinnedStaging | None = None
        if device.type == "cuda":
            self.pinned = PinnedStaging(nbytes, device)
            device_buffer, hosts = self.pinned.device_buffer, self.pinned.hosts
        else:
            device_buffer = torch.zeros(nbytes, dtype=torch.uint8)
            hosts = [device_buffer]
        self.tensors = self._views(device_buffer)
        self.host_views = [self._views(h, as_numpy=True) for h in hosts]

    def _views(self, buffer: torch.Tensor, as_numpy: bool = False) -> StartViews:
        ints = buffer[: self.int_bytes].view(torch.int64).view(len(START_FIELDS), self.max_seqs)
        tables = buffer[self.int_bytes :].view(torch.int32).view(self.max_seqs, self.max_blocks)
        if as_numpy:
            ints, tables = ints.numpy(), tables.numpy()
        return StartViews(dict(zip(START_FIELDS, ints)), tables)

    def staging(self, size: int) -> StartViews:
        """The staging views the next `send` copies, every field zeroed for `size` rows (the
        padding rows then write no KV: no blocks)."""
        host = self.host_views[0]
        if self.pinned is not None:
            self.pinned.next_host()
            host = self.host_views[self.pinned.turn]
        for values in host.fields.values():
            values[:size] = 0
        return host

    def send(self, size: int) -> None:
        """Copy the staged record of `size` rows (their whole block-table rows) in one copy."""
        if self.pinned is not None:
            self.pinned.send(self.int_bytes + size * self.max_blocks * 4)


class DraftChain:
    def __init__(self, step: DecodeStep, k: int, max_seqs: int) -> None:
        """step: the draft's static decode step, with room for 2 * max_seqs rows."""
        assert step.max_batch >= 2 * max_seqs
        self.step, self.k, self.max_seqs = step, k, max_seqs
        device = step.device
        self.start = ChainStart(max_seqs, step.buffers.layout.max_blocks, device)
        self.proposals = torch.zeros(max_seqs, k, dtype=torch.int64, device=device)
        self.offsets = torch.arange(k + 1, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # the chain with its start from a verify on the target's decode step: one graph each
        self.graphs_after_verify: dict[int, torch.cuda.CUDAGraph] = {}

    def padded_size(self, batch: int) -> int:
        if not self.graphs:
            return batch
        return min(size for size in self.graphs if size >= batch)

    def capture(self, target: DecodeStep) -> None:
        """Per size in capture_sizes (largest first, one pool), one graph of the whole chain
        and one of the chain started from a verify run on `target` (start_after_verify
        first); captured on the start buffers' initial contents (no blocks: no KV written)."""
        pool = None
        for index, size in enumerate(sorted(capture_sizes(self.max_seqs), reverse=True)):
            for graphs, after in ((self.graphs, None), (self.graphs_after_verify, target)):
                for _ in range(2 if index == 0 else 1):
                    self._forward_from(after, size)
                torch.cuda.synchronize(self.step.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._forward_from(after, size)
                pool = graph.pool() if pool is None else pool
                graphs[size] = graph
        torch.cuda.synchronize(self.step.device)
        logger.info("captured %d draft-chain graphs (k=%d)", 2 * len(self.graphs), self.k)

    def drop_graphs(self) -> None:
        """Run eagerly from now on (a capture failed)."""
        self.graphs.clear()
        self.graphs_after_verify.clear()

    def run(self, size: int, max_seq_len: int, after: DecodeStep | None = None) -> torch.Tensor:
        """The chain over the start record's first `size` rows, none of whose contexts
        exceeds max_seq_len (run eagerly, the attention reads that far; a graph was captured
        at the model's length); with `after`, its start first completed from the verify just
        run on that decode step (start_after_verify). Proposals [size, k] (device)."""
        graph = (self.graphs if after is None else self.graphs_after_verify).get(size)
        if graph is None:
            self._forward_from(after, size, min(max_seq_len, self.step.max_model_len))
        else:
            graph.replay()
        return self.proposals[:size]

    def _forward_from(self, after: DecodeStep | None, size: int, max_seq_len: int | None = None
                      ) -> None:  # fmt: skip
        if after is not None:
            self.start_after_verify(after, size)
        self.forward(size, max_seq_len)

    def forward(self, size: int, max_seq_len: int | None = None) -> None:
        """The pair step, then k - 1 single steps, each fed the previous argmax; contexts up
        to max_seq_len (None: the model's length)."""
        step, start = self.step, self.start.tensors
        last_pos = start.fields["last_pos"][:size]
        self._write_rows(0, size, last_pos - 1, start.fields["prev_token"][:size], True)
        self._write_rows(size, 2 * size, last_pos, start.fields["last_token"][:size], True)
        step.forward(2 * size, self._metadata(2 * size, max_seq_len))
        self.proposals[:size, 0].copy_(step.sampled[size : 2 * size])
        for i in range(1, self.k):
            self._write_rows(0, size, last_pos + i, self.proposals[:size, i - 1], False)
            step.forward(size, self._metadata(size, max_seq_len))
            self.proposals[:size, i].copy_(step.sampled[:size])

    def _metadata(self, rows: int, max_seq_len: int | None) -> AttentionMetadata:
        """The draft step's metadata over `rows` rows; on the CPU with the host views (which
        the CPU backend reads: there they are the buffers written)."""
        step = self.step
        host = None if step.buffers.pinned is not None else step.buffers.host_views[0]
        return step.metadata(rows, max_seq_len or step.max_model_len, host)

    def _write_rows(
        self, lo: int, hi: int, positions: torch.Tensor, tokens: torch.Tensor, tables: bool
    ) -> None:
        """Decode rows [lo, hi): request i = row - lo at `positions[i]` with `tokens[i]`."""
        step, start, block_size = self.step, self.start.tensors, self.step.block_size
        t = step.buffers.tensors
        capacity = start.fields["num_blocks"][: hi - lo] * block_size
        block_index = torch.minimum(positions // block_size, capacity // block_size - 1)
        row_tables = start.tables[: hi - lo]
        blocks = row_tables.gather(1, block_index.clamp(min=0).unsqueeze(1)).squeeze(1)
        inside = (positions >= 0) & (positions < capacity)
        t.token_ids[lo:hi].copy_(tokens)
        t.positions[lo:hi].copy_(positions.clamp(0, step.max_model_len - 1))
        t.slot_mapping[lo:hi].copy_(
            torch.where(inside, blocks * block_size + positions % block_size, -1)
        )
        t.seq_lens[lo:hi].copy_(torch.minimum(positions + 1, capacity).clamp(min=1))
        if tables:
            t.block_tables[lo:hi].copy_(row_tables)

    def start_after_verify(self, target: DecodeStep, size: int) -> None:
        """The start record from a verify step run as a decode step on `target` (its inputs
        still in its buffers, its samples in target.sampled): per request, the staged
        verify_row (the row of its last known token) and num_drafts give its accepted drafts
        a, then P = that row's position + a + 1, the token at P - 1 (the input of row + a)
        and at P (the target's sample at row + a)."""
        fields, k = self.start.tensors.fields, self.k
        rows = fields["verify_row"][:size]
        index = (rows.unsqueeze(1) + self.offsets).clamp(max=target.max_batch - 1)
        samples = target.sampled[index]  # [size, k + 1]
        drafts = target.buffers.tensors.token_ids[index[:, 1:]]
        valid = self.offsets[:k] < fields["num_drafts"][:size].unsqueeze(1)
        accepted = ((drafts == samples[:, :k]) & valid).long().cumprod(dim=1).sum(dim=1)
        last_row = rows + accepted
        fields["last_pos"][:size].copy_(target.buffers.tensors.positions[last_row] + 1)
        fields["prev_token"][:size].copy_(target.buffers.tensors.token_ids[last_row])
        fields["last_token"][:size].copy_(samples.gather(1, accepted.unsqueeze(1)).squeeze(1))
