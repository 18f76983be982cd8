"""Attention metadata: what every attention backend reads for one step (shared by all layers).

Token-major view of the paged KV cache: token t of a request lives at
slot = block_table[t // block_size] * block_size + t % block_size; `slot_mapping[i]` is the slot
of the i-th token of the step (the flattened batch, requests back to back, q_len_b >= 1 new
tokens each). Request b has seq_len_b tokens in context once this step's keys are written (new
ones included). Slot -1 marks a padding row (written nowhere).

The device tensors (slot_mapping, query_start_loc, seq_lens, block_tables) are the kernels'
inputs; their host copies (query_lens_cpu, seq_lens_cpu, block_tables_cpu) let the CPU
backends plan a step without reading the device. A backend's per-step plan is built on first
use and kept in `plans` (keyed by the backend: `plan`), so every layer of the step shares it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class OutputRows:
    """The token rows whose final hidden states the step needs (its logits rows) and a
    decode-style metadata attending each of them alone over its full context: the model's
    last layer then runs attention, o_proj and the MLP for these rows only."""

    indices: torch.Tensor  # [n] int64 token rows, device
    metadata: AttentionMetadata  # n one-token requests


@dataclass
class AttentionMetadata:
    """Everything an attention backend needs for one step (shared by all layers)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, device
    query_start_loc: torch.Tensor  # [batch + 1] int32, device
    seq_lens: torch.Tensor  # [batch] int32, device
    block_tables: torch.Tensor  # [batch, max_num_blocks] int32, device
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_lens_cpu: torch.Tensor  # [batch] int64
    seq_lens_cpu: torch.Tensor  # [batch] int64
    block_tables_cpu: torch.Tensor  # [batch, max_num_blocks] int32
    # the prefill kernels' launch order (longest_first_order); None: batch order
    longest_first: torch.Tensor | None = None  # [2 * batch + 1] int32, device
    output_rows: OutputRows | None = None  # None: every row's hidden state is needed
    plans: dict[Any, Any] = field(default_factory=dict)  # backends' plans, built once per step

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    def plan(self, key: Hashable, build: Callable[[], T]) -> T:
        """The step's plan of `key` (a backend's), built by `build` on first use."""
        if key not in self.plans:
            self.plans[key] = build()
        return self.plans[key]


def build_attention_metadata(
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """From CPU tensors: query_lens/seq_lens [B] int64, block_tables [B, W] int32 (W blocks
    cover the longest context), slot_mapping [num_tokens] int64. (The model runner does the
    two halves itself, metadata_inputs then assemble_attention_metadata, so that one transfer
    carries all of a step's inputs.)"""
    non_blocking = device.type == "cuda"
    inputs = metadata_inputs(query_lens, seq_lens, block_tables, slot_mapping)
    uploaded = [t.to(device, non_blocking=non_blocking) for t in inputs]
    return assemble_attention_metadata(uploaded, query_lens, seq_lens, block_tables, block_size)


def longest_first_order(query_lens: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """The prefill launch order of a step, longest first, as one int32 tensor [2 * batch + 1]:
    order [batch] (the requests by decreasing seq_len, ties in batch order) then starts
    [batch + 1] (the cumulative query_lens in that order, from 0). Computed once per step on
    the host; the prefill kernels launch the longest requests' query blocks first, so that the
    short ones fill the tail of the grid."""
    order = torch.sort(seq_lens, descending=True, stable=True).indices
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
    torch.cumsum(query_lens[order], 0, out=starts[1:])
    return torch.cat([order, starts]).to(torch.int32)


def metadata_inputs(
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> list[torch.Tensor]:
    """The device half of AttentionMetadata as CPU tensors in the kernels' dtypes:
    slot_mapping int64, query_start_loc [B + 1] int32, seq_lens int32, block_tables int32,
    longest_first [2B + 1] int32 (longest_first_order; decode-only steps ignore it)."""
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    torch.cumsum(query_lens, 0, out=query_start_loc[1:])
    return [
        slot_mapping.to(torch.int64),
        query_start_loc,
        seq_lens.to(torch.int32),
        block_tables.to(torch.int32),
        longest_first_order(query_lens, seq_lens),
    ]


def assemble_attention_metadata(
    device_inputs: list[torch.Tensor],
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
) -> AttentionMetadata:
    """AttentionMetadata from metadata_inputs' tensors on the device and the host tensors."""
    slot_mapping, query_start_loc, device_seq_lens, device_block_tables, order = device_inputs
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=device_seq_lens,
        block_tables=device_block_tables,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_size=block_size,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        block_tables_cpu=block_tables,
        longest_first=order,
    )
