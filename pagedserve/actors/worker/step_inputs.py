"""The flattened inputs of a general step (prefill chunks and decodes mixed) on the device.

For each scheduled request the step computes `num_scheduled_tokens` tokens from its
`num_computed_tokens` on: their token ids (a token the step in flight samples is not known on
the host yet: it is copied on the device from that step's output), positions, KV slots, the
attention metadata, and the rows whose logits are needed: the last token of every request whose
scheduled tokens reach the end of the tokens the worker knows for it (it samples), and with
speculative decoding the rows of its drafts too (it samples after each of its last 1 + drafts
tokens), then the rows whose logits give prompt logprobs (prompt_logprobs.py), then the rows
whose hidden states pooling requests pool (pooling.py; such a request never samples). In a step
with prefill tokens the model's last layer, past caching every token's k/v, runs only those
rows (AttentionMetadata.output_rows). Every array goes to the device in one upload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from pagedserve.actors.worker import prompt_logprobs
from pagedserve.actors.worker.input_batch import InputBatch
from pagedserve.actors.worker.pooling import Pooler, PoolingRows
from pagedserve.actors.worker.prompt_logprobs import PromptLogprobRows
from pagedserve.actors.worker.uploader import Uploader
from pagedserve.kernels.attention_metadata import (
    AttentionMetadata,
    OutputRows,
    assemble_attention_metadata,
    cdiv,
    metadata_inputs,
)

HostMetadata = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64, device
    positions: torch.Tensor  # [num_tokens] int64, device
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_logits] token rows whose logits are needed
    sampling_rows: np.ndarray  # [num_logits] persistent-batch row of each logits row
    sampling_positions: np.ndarray  # [num_logits] position of the token each one samples
    sampling_handles: list[int]  # the requests that sample
    sampling_counts: np.ndarray  # logits rows of each (1 + its drafts)
    # rows whose logits give prompt logprobs: after the sampling rows in logits_indices
    prompt_logprobs: PromptLogprobRows | None = None
    # rows whose hidden states pooling requests pool: after those in logits_indices
    pooling: PoolingRows | None = None

    @property
    def num_prompt_logprob_rows(self) -> int:
        rows = self.prompt_logprobs
        return 0 if rows is None else len(rows.token_index)


def _metadata_host(
    query_lens: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, slots: np.ndarray
) -> HostMetadata:
    """(query_lens, seq_lens, block_tables, slot_mapping) as CPU tensors sharing the arrays."""
    arrays = (query_lens, seq_lens, np.ascontiguousarray(block_tables), slots)
    return tuple(torch.from_numpy(a) for a in arrays)  # type: ignore[return-value]


@dataclass
class _LogitsRows:
    """The step's token rows whose logits are needed, with each one's request (its index in
    the step) and sequence length (its position + 1): the sampling rows, then others."""

    samples: np.ndarray  # [requests] bool: the request samples
    counts: np.ndarray  # [sampling requests] its logits rows (1 + its drafts)
    sampling_positions: np.ndarray  # [sampling rows] position of the token each samples
    indices: np.ndarray
    requests: np.ndarray
    seq_lens: np.ndarray

    def add(self, indices: np.ndarray, requests: np.ndarray, seq_lens: np.ndarray) -> None:
        self.indices = np.concatenate([self.indices, indices])
        self.requests = np.concatenate([self.requests, requests])
        self.seq_lens = np.concatenate([self.seq_lens, seq_lens])


def _logits_rows(
    samples: np.ndarray, num_drafts: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray
) -> _LogitsRows:
    """Each sampling request's last 1 + drafts token rows (it samples after each)."""
    counts = num_drafts[samples] + 1
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    first = np.cumsum(query_lens)[samples] - counts  # each one's first logits row
    positions = np.repeat(seq_lens[samples] - counts + 1, counts) + within
    return _LogitsRows(
        samples, counts, positions, np.repeat(first, counts) + within,
        np.repeat(np.flatnonzero(samples), counts), positions,
    )  # fmt: skip


class _TokenLayout(NamedTuple):
    """Per token of a step: its id on the host, position and KV slot; and the tokens the step
    in flight samples (`targets`, indices into the step's tokens; `sources`, into its output)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    targets: np.ndarray
    sources: np.ndarray


def _token_layout(
    batch: InputBatch, rows: np.ndarray, computed: np.ndarray, query_lens: np.ndarray,
    pending_index: np.ndarray, block_size: int,
) -> _TokenLayout:  # fmt: skip
    request_of_token = np.repeat(np.arange(len(rows)), query_lens)
    query_starts = np.cumsum(query_lens) - query_lens
    offsets = np.arange(len(request_of_token)) - query_starts[request_of_token]
    positions = computed[request_of_token] + offsets
    token_rows = rows[request_of_token]
    input_ids = batch.token_ids[token_rows, positions].astype(np.int64)
    # tokens sampled by the step in flight: copied on the device from its output
    in_flight = pending_index[request_of_token] >= 0
    targets = np.flatnonzero((positions == batch.num_tokens[token_rows]) & in_flight)
    sources = pending_index[request_of_token[targets]]
    blocks = batch.block_table_np[token_rows, positions // block_size].astype(np.int64)
    slot_mapping = blocks * block_size + positions % block_size
    return _TokenLayout(input_ids, positions, slot_mapping, targets, sources)


def check_plan_fits(
    batch: InputBatch, rows: np.ndarray, seq_lens: np.ndarray, known: np.ndarray, block_size: int
) -> None:
    """A plan may only compute tokens the worker knows, into blocks it was given."""
    if (seq_lens > known).any():
        raise ValueError("a step schedules tokens the worker does not know")
    if (seq_lens > batch.num_blocks[rows] * block_size).any():
        raise ValueError("a step schedules tokens beyond the block tables")


class StepInputBuilder:
    def __init__(
        self,
        batch: InputBatch,
        uploader: Uploader,
        sampled: torch.Tensor,
        block_size: int,
        pooler: Pooler,
    ) -> None:
        self.batch, self.uploader, self.sampled = batch, uploader, sampled
        self.block_size, self.pooler = block_size, pooler
        # a step with prefill runs its last layer on the logits rows only (output_rows); off
        # where each token's layers must see the whole step (LoRA's token groups: lora.py)
        self.narrow_last_layer = True

    def build(
        self,
        handles: list[int],
        num_scheduled: list[int],
        rows: np.ndarray,
        pending_index: np.ndarray,
        num_drafts: np.ndarray,
    ) -> StepInputs:
        """The step's inputs; advances the rows' num_computed_tokens. pending_index[i] is the
        index of row i's token in the step in flight (-1: none); num_drafts[i] the drafts it
        verifies (written after its known tokens)."""
        batch, block_size = self.batch, self.block_size
        query_lens = np.asarray(num_scheduled, dtype=np.int64)
        if len(query_lens) != len(rows) or (query_lens < 1).any():
            raise ValueError("a step needs >= 1 token per scheduled request")
        known = batch.num_tokens[rows] + (pending_index >= 0) + num_drafts
        computed = batch.num_computed_tokens[rows]
        seq_lens = computed + query_lens
        check_plan_fits(batch, rows, seq_lens, known, block_size)
        tokens = _token_layout(batch, rows, computed, query_lens, pending_index, block_size)
        block_tables = batch.block_table_np[rows, : cdiv(int(seq_lens.max()), block_size)]
        batch.num_computed_tokens[rows] = seq_lens
        samples = seq_lens >= known
        if batch.pooling:  # a pooling request never samples
            samples &= ~batch.pools[rows]
        out = _logits_rows(samples, num_drafts, query_lens, seq_lens)
        prompt_rows = prompt_logprobs.select_rows(batch, handles, rows, computed, query_lens)
        if prompt_rows is not None:  # their rows follow the sampling rows
            out.add(prompt_rows.token_index, prompt_rows.request_index, prompt_rows.positions + 1)
        pooling = self.pooler.select_rows(handles, rows, computed, query_lens)
        if pooling is not None:  # and the pooling rows follow those
            out.add(pooling.token_index, pooling.request_index, pooling.positions + 1)
        host = _metadata_host(query_lens, seq_lens, block_tables, tokens.slot_mapping)
        device_ids, device_positions, device_logits, metadata = self._upload(
            tokens, out, host, block_tables
        )
        return StepInputs(
            input_ids=device_ids,
            positions=device_positions,
            attn_metadata=metadata,
            logits_indices=device_logits,
            sampling_rows=np.repeat(rows[out.samples], out.counts),
            sampling_positions=out.sampling_positions,
            sampling_handles=[h for h, s in zip(handles, out.samples.tolist()) if s],
            sampling_counts=out.counts,
            prompt_logprobs=prompt_rows,
            pooling=pooling,
        )

    def _upload(
        self, tokens: _TokenLayout, out: _LogitsRows, host: HostMetadata, block_tables: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Every array on the device in one upload (in a step with prefill, the last layer's
        metadata for the logits rows too), and the tokens the step in flight samples copied
        into the ids: (ids, positions, logits indices, attention metadata)."""
        arrays = [tokens.input_ids, tokens.positions, tokens.targets, tokens.sources, out.indices]
        arrays += [t.numpy() for t in metadata_inputs(*host)]
        # prefill in the step: the last layer needs only the logits rows past its k/v
        rows_host = None
        if self.narrow_last_layer and 0 < len(out.indices) < len(tokens.slot_mapping):
            rows_host = _metadata_host(
                np.ones(len(out.indices), np.int64), out.seq_lens,
                block_tables[out.requests], tokens.slot_mapping[out.indices],
            )  # fmt: skip
            arrays += [t.numpy() for t in metadata_inputs(*rows_host)]
        device_ids, device_positions, device_targets, device_sources, device_logits, *rest = (
            self.uploader.upload(arrays)
        )
        fields = len(rest) // (1 if rows_host is None else 2)  # metadata_inputs' tensors
        metadata = self._assemble(rest[:fields], host)
        if rows_host is not None:
            output_rows = self._assemble(rest[fields:], rows_host)
            metadata.output_rows = OutputRows(device_logits, output_rows)
        if len(tokens.targets):
            fed = self.sampled.index_select(0, device_sources)
            device_ids.index_copy_(0, device_targets, fed)
        return device_ids, device_positions, device_logits, metadata

    def _assemble(self, device_inputs: list[torch.Tensor], host: HostMetadata) -> AttentionMetadata:
        query_lens, seq_lens, block_tables, _ = host
        return assemble_attention_metadata(
            device_inputs, query_lens, seq_lens, block_tables, self.block_size
        )
