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
  every speculative step's tokens (`observe`, its KV follows the target's; after steps
  without speculation it catches up first: draft_kv.py), then greedily decodes k drafts
  from the request's last token in one chain on the device (draft_chain.py: one CUDA graph on
  a GPU); after a verify step run as a decode step, the chain starts from the verify's
  samples on the device, so the step has one device-to-host sync (verify_step.py).
"""

from __future__ import annotations

from typing import Protocol

import msgspec
import numpy as np
import torch
from torch import nn

from pagedserve.actors.worker.cuda_graphs import DecodeStep
from pagedserve.actors.worker.draft_chain import DraftChain, StartViews
from pagedserve.actors.worker.draft_kv import DraftCoverage
from pagedserve.actors.worker.input_batch import InputBatch
from pagedserve.actors.worker.step_inputs import StepInputs
from pagedserve.config import EngineConfig, SpeculativeConfig
from pagedserve.models.layers import Attention
from pagedserve.models.loader import load_model


def num_accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts the target accepts: the longest prefix equal to its own samples."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == sampled[accepted]:
        accepted += 1
    return accepted


class Proposer(Protocol):
    # a model's KV cache of its own: what it holds (draft_kv.py); None: no cache
    coverage: DraftCoverage | None

    def observe(self, inputs: StepInputs) -> None:
        """See the step's input tokens (a model-based proposer runs over them)."""

    def propose(self, batch: InputBatch, rows: np.ndarray) -> list[list[int]]:
        """Drafts for each of `rows`, after their tokens so far."""

    def propose_after_verify(
        self, target: DecodeStep, batch: InputBatch, rows: np.ndarray, verify_rows: np.ndarray,
        num_drafts: np.ndarray,
    ) -> torch.Tensor | None:  # fmt: skip
        """Drafts [len(rows), k] on the device, computed there right after a verify step run
        as a decode step on `target`, without the host learning its tokens; None: this
        proposer needs them on the host (`propose` afterwards)."""


class NgramProposer:
    def __init__(self, spec: SpeculativeConfig) -> None:
        self.k = spec.num_speculative_tokens
        self.min_n, self.max_n = spec.prompt_lookup_min, spec.prompt_lookup_max
        self.coverage = None

    def observe(self, inputs: StepInputs) -> None:
        pass

    def propose_after_verify(self, *args: object) -> None:
        return None  # lookups read the tokens on the host

    def propose(self, batch: InputBatch, rows: np.ndarray) -> list[list[int]]:
        return [self.lookup(batch.token_ids[row, : batch.num_tokens[row]]) for row in rows]

    def lookup(self, tokens: np.ndarray) -> list[int]:
        """The k tokens after the latest earlier occurrence of the longest suffix n-gram
        (prompt_lookup_max down to prompt_lookup_min): a byte search (bytes.rfind) of the
        suffix's int32 bytes in those of the tokens before the last, where a match counts
        only if it starts on a token (a few µs, where numpy's calls cost tens)."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        earlier = tokens[:-1].tobytes()
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:].tobytes()
            end = len(earlier)
            while (at := earlier.rfind(suffix, 0, end)) >= 0:
                if at % 4 == 0:
                    start = at // 4 + n
                    return tokens[start : start + self.k].tolist()
                end = at + len(suffix) - 1  # a match across tokens: look before it
        return []


class DraftModelProposer:
    def __init__(self, config: EngineConfig, device: torch.device, spec: SpeculativeConfig):
        assert spec.model is not None and config.max_model_len is not None
        draft_config = msgspec.structs.replace(config, model=spec.model, load_format="auto")
        self.model: nn.Module = load_model(draft_config, device)
        self.k = spec.num_speculative_tokens
        self.layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.dtype = self.model.layer_config.cache_dtype  # its KV cache's element type
        rows = 2 * config.max_num_seqs  # the chain's pair step: two rows per request
        sampled = torch.zeros(rows, dtype=torch.int64, device=device)
        step = DecodeStep(self.model, sampled, rows, config.max_model_len, config.block_size)  # type: ignore[arg-type]
        self.chain = DraftChain(step, self.k, config.max_num_seqs)
        self.block_size, self.max_rows = config.block_size, config.max_num_seqs
        self.coverage: DraftCoverage | None = None  # bind_kv_cache

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """[layers, 2, *one layer's cache] of the draft's own cache, in the target's layout."""
        layer = self.layers[0]
        per_layer = self.model.layer_config.attention.kv_cache_layer_shape(
            num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim
        )
        return (len(self.layers), 2, *per_layer)

    def bind_kv_cache(self, kv_cache: torch.Tensor, num_blocks: int) -> None:
        for index, layer in enumerate(self.layers):
            layer.k_cache, layer.v_cache = kv_cache[index, 0], kv_cache[index, 1]
        self.coverage = DraftCoverage(self.max_rows, num_blocks, self.block_size)

    @torch.inference_mode()
    def observe(self, inputs: StepInputs) -> None:
        self.model(inputs.input_ids, inputs.positions, inputs.attn_metadata)

    @torch.inference_mode()
    def propose(self, batch: InputBatch, rows: np.ndarray) -> list[list[int]]:
        """k greedy decodes of the draft from each row's last token (draft_chain.py), its
        start record from the host."""
        host, size = self._stage(batch, rows)
        last = batch.num_tokens[rows] - 1
        host.fields["last_pos"][: len(rows)] = last
        host.fields["prev_token"][: len(rows)] = batch.token_ids[rows, np.maximum(last - 1, 0)]
        host.fields["last_token"][: len(rows)] = batch.token_ids[rows, last]
        self.chain.start.send(size)
        longest = int(last.max()) + self.k + 1
        return self.chain.run(size, longest)[: len(rows)].tolist()

    @torch.inference_mode()
    def propose_after_verify(
        self, target: DecodeStep, batch: InputBatch, rows: np.ndarray, verify_rows: np.ndarray,
        num_drafts: np.ndarray,
    ) -> torch.Tensor:  # fmt: skip
        """The drafts after a verify step that `target` ran as a decode step (row
        verify_rows[i] holds request i's last known token, its num_drafts[i] drafts follow),
        with no host round trip: [len(rows), k] on the device."""
        host, size = self._stage(batch, rows)
        host.fields["verify_row"][: len(rows)] = verify_rows
        host.fields["num_drafts"][: len(rows)] = num_drafts
        self.chain.start.send(size)
        longest = int((batch.num_tokens[rows] + num_drafts).max()) + self.k
        return self.chain.run(size, longest, after=target)[: len(rows)]

    def _stage(self, batch: InputBatch, rows: np.ndarray) -> tuple[StartViews, int]:
        """The start record's staging views with the rows' blocks, and the chain's size."""
        size = self.chain.padded_size(len(rows))
        host = self.chain.start.staging(size)
        num_blocks = batch.num_blocks[rows]
        host.fields["num_blocks"][: len(rows)] = num_blocks
        width = int(num_blocks.max())
        host.tables[: len(rows), :width] = batch.block_table_np[rows, :width]
        return host, size


def decode_rows(config: EngineConfig) -> int:
    """Rows of the target's static decode step: a row per request, or with speculation room
    for every request's verify as one decode step (1 + k rows each)."""
    spec = config.speculative_config
    return config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))


def make_proposer(config: EngineConfig, device: torch.device) -> Proposer | None:
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec)
    return DraftModelProposer(config, device, spec)
