"""Speculative decoding in the worker: proposers, and the verification rule.

A proposer suggests up to k draft tokens per request for its next step, after this step's
tokens are known (`propose`); the scheduler schedules them and the next step verifies them in
one target forward pass, sampling the target's token after each draft.

Verification (`num_accepted`). Every draw is counter-based: the token the target samples at a
position is a function of that position's logits and the request's RNG key (Gumbel-max, see
sampler.py). So a draft is accepted exactly when it equals the token the target samples at its
position, and the first rejected position emits the target's own token there: the output is the
token sequence the target alone produces (greedy or seeded: identical; unseeded: the same
distribution). For a deterministic proposal d this is the standard rule with a point-mass draft
distribution: d is accepted with probability p(d) and a rejection samples from p with d removed.

Proposers, behind the small `Proposer` protocol (EAGLE heads or MTP layers would fit it):
- n-gram prompt lookup: the tokens that followed the latest earlier occurrence of the request's
  longest suffix n-gram (prompt_lookup_max down to prompt_lookup_min), from its own tokens.
- a draft model with the target's vocabulary, run by the same worker on its own paged KV cache
  (the target's block tables and slots; the scheduler holds k lookahead slots for it). It reads
  every step's tokens (`observe`, its KV follows the target's), then greedily decodes k drafts
  from the request's last token through the static decode path (CUDA graphs on a GPU).
"""

from __future__ import annotations

from typing import Protocol

import msgspec
import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from torch import nn

from pagedserve.actors.worker.cuda_graphs import DecodeStep
from pagedserve.actors.worker.input_batch import InputBatch
from pagedserve.actors.worker.step_inputs import StepInputs
from pagedserve.config import EngineConfig, SpeculativeConfig
from pagedserve.kernels.attention_metadata import cdiv
from pagedserve.models.layers import Attention
from pagedserve.models.loader import load_model


def num_accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts the target accepts: the longest prefix equal to its own samples."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == sampled[accepted]:
        accepted += 1
    return accepted


class Proposer(Protocol):
    def observe(self, inputs: StepInputs) -> None:
        """See the step's input tokens (a model-based proposer runs over them)."""

    def propose(self, batch: InputBatch, rows: np.ndarray) -> list[list[int]]:
        """Drafts for each of `rows`, after their tokens so far."""


class NgramProposer:
    def __init__(self, spec: SpeculativeConfig) -> None:
        self.k = spec.num_speculative_tokens
        self.min_n, self.max_n = spec.prompt_lookup_min, spec.prompt_lookup_max

    def observe(self, inputs: StepInputs) -> None:
        pass

    def propose(self, batch: InputBatch, rows: np.ndarray) -> list[list[int]]:
        return [self.lookup(batch.token_ids[row, : batch.num_tokens[row]]) for row in rows]

    def lookup(self, tokens: np.ndarray) -> list[int]:
        """The k tokens after the latest earlier occurrence of the longest suffix n-gram."""
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            windows = sliding_window_view(tokens[:-1], n)  # every n-gram but the suffix itself
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start : start + self.k].tolist()
        return []


class DraftModelProposer:
    def __init__(self, config: EngineConfig, device: torch.device, spec: SpeculativeConfig):
        assert spec.model is not None and config.max_model_len is not None
        draft_config = msgspec.structs.replace(config, model=spec.model, load_format="auto")
        self.model: nn.Module = load_model(draft_config, device)
        self.k = spec.num_speculative_tokens
        self.layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.dtype = self.model.layer_config.cache_dtype  # its KV cache's element type
        self.sampled = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=device)
        self.step = DecodeStep(
            self.model, self.sampled, config.max_num_seqs, config.max_model_len, config.block_size
        )  # type: ignore[arg-type]
        self.block_size = config.block_size

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """[layers, 2, *one layer's cache] of the draft's own cache, in the target's layout."""
        layer = self.layers[0]
        per_layer = self.model.layer_config.attention.kv_cache_layer_shape(
            num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim
        )
        return (len(self.layers), 2, *per_layer)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        for index, layer in enumerate(self.layers):
            layer.k_cache, layer.v_cache = kv_cache[index, 0], kv_cache[index, 1]

    @torch.inference_mode()
    def observe(self, inputs: StepInputs) -> None:
        self.model(inputs.input_ids, inputs.positions, inputs.attn_metadata)

    @torch.inference_mode()
    def propose(self, batch: InputBatch, rows: np.ndarray) -> list[list[int]]:
        """k greedy decodes of the draft from each row's last token. The first reads the last
        two known tokens (the draft never read a fully accepted step's last draft), which also
        fills the draft's KV where a verify step ran on the decode path."""
        num_rows, last = len(rows), batch.num_tokens[rows] - 1
        if 2 * num_rows <= self.step.max_batch:
            pairs = np.stack([last - 1, last], axis=1).reshape(-1)
            self._decode(batch, np.repeat(rows, 2), pairs, None)
            feed = 2 * np.arange(num_rows) + 1  # each pair's second row
        else:
            self._decode(batch, rows, last - 1, None)
            self._decode(batch, rows, last, None)
            feed = np.arange(num_rows)
        drafts = [self.sampled[feed].clone()]
        for i in range(1, self.k):
            self._decode(batch, rows, last + i, feed)
            feed = np.arange(num_rows)
            drafts.append(self.sampled[:num_rows].clone())
        return torch.stack(drafts, dim=1).tolist()

    def _decode(
        self, batch: InputBatch, rows: np.ndarray, positions: np.ndarray, feed: np.ndarray | None
    ) -> None:
        """One draft decode step at `positions`: the row's known token, or the draft's output
        at index feed[i] of the previous step; KV past the row's blocks is not written."""
        step, block_size, num_rows = self.step, self.block_size, len(rows)
        size = step.padded_size(num_rows)
        host = step.buffers.staging()
        known = np.minimum(positions, batch.token_capacity - 1)
        host.token_ids[:num_rows] = batch.token_ids[rows, known]
        host.feed_index[:num_rows] = -1 if feed is None else feed
        host.positions[:num_rows] = positions
        block_index = np.minimum(positions // block_size, batch.num_blocks[rows] - 1)
        blocks = batch.block_table_np[rows, block_index]
        in_table = positions < batch.num_blocks[rows] * block_size
        slots = blocks * block_size + positions % block_size
        host.slot_mapping[:num_rows] = np.where(in_table, slots, -1)
        seq_lens = np.minimum(positions + 1, batch.num_blocks[rows] * block_size)
        host.seq_lens[:num_rows] = seq_lens
        max_seq_len = int(seq_lens.max())
        width = cdiv(max_seq_len, block_size)
        host.block_tables[:num_rows, :width] = batch.block_table_np[rows, :width]
        host.pad(num_rows, size)
        step.run(num_rows, size, max_seq_len, host)


def make_proposer(config: EngineConfig, device: torch.device) -> Proposer | None:
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec)
    return DraftModelProposer(config, device, spec)
