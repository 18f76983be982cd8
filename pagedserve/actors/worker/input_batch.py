"""The worker's persistent batch: its cache of the requests it runs, one row per request.

The scheduler owns every request's state; a worker keeps a copy of what its steps need, keyed by
the request's handle: rows are preallocated (max_num_seqs x max_model_len tokens, a block table
of the matching width, sampling settings and RNG key) and updated in place from each StepPlan's
diff; a step gathers the rows of its scheduled requests by index. Token ids include the tokens
this worker sampled. A request resumed after preemption arrives whole again (NewRequestData):
its prompt length, so penalties count its earlier output as output, and its RNG key, so its
draws continue where they stopped (they depend only on the key and the token's position).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.actors.messages import NewRequestData, PoolingParams, SamplingParams
from pagedserve.actors.worker.sampler import (
    AllowedTokens,
    BannedTokens,
    LogitBias,
    PenaltyState,
    SamplingMetadata,
)
from pagedserve.kernels.attention_metadata import cdiv

GREEDY_TEMPERATURE = 1e-5


@dataclass
class _SamplingColumns:
    """Sampling settings per row, as numpy columns."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    presence: np.ndarray
    frequency: np.ndarray
    repetition: np.ndarray
    num_logprobs: np.ndarray  # -1: not asked
    plain_greedy: np.ndarray  # bool: greedy, no penalties, no bias, no logprobs, no grammar
    num_prompt_logprobs: np.ndarray  # -1: not asked

    @classmethod
    def allocate(cls, rows: int) -> _SamplingColumns:
        f32 = np.float32
        return cls(
            np.ones(rows, f32), np.zeros(rows, np.int64), np.ones(rows, f32), np.zeros(rows, f32),
            np.zeros(rows, f32), np.zeros(rows, f32), np.ones(rows, f32),
            np.full(rows, -1, np.int64), np.ones(rows, bool), np.full(rows, -1, np.int64),
        )  # fmt: skip

    def set_row(self, row: int, params: SamplingParams) -> None:
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty
        self.repetition[row] = params.repetition_penalty
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.plain_greedy[row] = (
            params.temperature < GREEDY_TEMPERATURE
            and params.logprobs is None
            and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0
            and params.repetition_penalty == 1.0
            and params.structured_outputs is None
            and not params.logit_bias
            and params.allowed_token_ids is None
            and not params.bad_words_token_ids
        )
        self.num_prompt_logprobs[row] = (
            -1 if params.prompt_logprobs is None else params.prompt_logprobs
        )


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, block_size: int, device: torch.device
    ) -> None:
        self.max_num_reqs, self.block_size, self.device = max_num_reqs, block_size, device
        self.token_capacity = max_model_len + 1  # room for a token sampled past the limit
        self.row_of: dict[int, int] = {}  # handle -> row
        self._free_rows = list(range(max_num_reqs))
        self.token_ids = np.zeros((max_num_reqs, self.token_capacity), np.int32)
        self.num_tokens = np.zeros(max_num_reqs, np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, np.int64)
        # its length once max_tokens are out (max_model_len without max_tokens)
        self.length_limit = np.zeros(max_num_reqs, np.int64)
        max_blocks = cdiv(self.token_capacity, block_size)
        self.block_table = torch.zeros((max_num_reqs, max_blocks), dtype=torch.int32)
        self.block_table_np = self.block_table.numpy()
        self.num_blocks = np.zeros(max_num_reqs, np.int64)
        self.sampling = _SamplingColumns.allocate(max_num_reqs)
        self.seeds = np.zeros(max_num_reqs, np.int64)  # each request's RNG key
        # rows whose sampling reads their past tokens on the host (penalties, bad words)
        self.history_rows: set[int] = set()
        self.biases: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # row -> (tokens, biases)
        self.allowed: dict[int, np.ndarray] = {}  # row -> the only tokens it may sample
        self.bad_words: dict[int, list[list[int]]] = {}  # row -> token sequences it must not end
        # pooling requests (embeddings: worker/pooling.py), which never sample: the rows that
        # pool, their PoolingParams, and what their earlier prompt chunks pooled (MEAN, CLS)
        self.pools = np.zeros(max_num_reqs, bool)
        self.pooling: dict[int, PoolingParams] = {}
        self.pooled_so_far: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.row_of)

    def add_request(self, data: NewRequestData) -> int:
        """A new (or resumed) request: a handle this batch must not hold already."""
        if data.handle in self.row_of:
            raise ValueError(f"request {data.handle} is already in the persistent batch")
        if not self._free_rows:
            raise RuntimeError(f"persistent batch is full ({self.max_num_reqs} requests)")
        num_tokens = len(data.token_ids)
        if num_tokens > self.token_capacity or not 0 < data.num_prompt_tokens <= num_tokens:
            raise ValueError(f"request {data.handle} has {num_tokens} tokens, over the limit")
        row = heapq.heappop(self._free_rows)
        self.row_of[data.handle] = row
        self.token_ids[row, :num_tokens] = data.token_ids
        self.num_tokens[row] = num_tokens
        self.num_prompt_tokens[row] = data.num_prompt_tokens
        self.num_computed_tokens[row] = data.num_computed_tokens
        max_tokens, most = data.sampling.max_tokens, self.token_capacity - 1
        limit = most if max_tokens is None else min(data.num_prompt_tokens + max_tokens, most)
        self.length_limit[row] = limit
        self.num_blocks[row] = 0
        self.append_block_ids(row, data.block_ids)
        self.sampling.set_row(row, data.sampling)
        if data.sampling.logit_bias:
            bias = data.sampling.logit_bias
            self.biases[row] = (np.fromiter(bias, np.int64), np.fromiter(bias.values(), np.float32))
        if data.sampling.allowed_token_ids is not None:
            self.allowed[row] = np.asarray(data.sampling.allowed_token_ids, np.int64)
        if data.sampling.bad_words_token_ids:
            self.bad_words[row] = data.sampling.bad_words_token_ids
        self.seeds[row] = data.seed
        self.pools[row] = data.pooling is not None
        if data.pooling is not None:
            self.pooling[row] = data.pooling
        if self.needs_token_history(np.array([row])):
            self.history_rows.add(row)
        return row

    def remove_request(self, handle: int) -> None:
        row = self.row_of.pop(handle, None)
        if row is not None:
            self.history_rows.discard(row)
            self.biases.pop(row, None)
            self.allowed.pop(row, None)
            self.bad_words.pop(row, None)
            self.pools[row] = False
            self.pooling.pop(row, None)
            self.pooled_so_far.pop(row, None)
            heapq.heappush(self._free_rows, row)

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        self.block_table_np[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Append one sampled token to each row (dropped where a row is already full)."""
        positions = self.num_tokens[rows]
        fits = positions < self.token_capacity
        self.token_ids[rows[fits], positions[fits]] = token_ids[fits]
        self.num_tokens[rows[fits]] += 1

    def write_drafts(self, row: int, draft_ids: list[int]) -> None:
        """Speculative decoding: drafts to verify, written after the row's known tokens (the
        step reads its inputs there) but not counted in them."""
        start = int(self.num_tokens[row])
        stop = min(start + len(draft_ids), self.token_capacity)
        self.token_ids[row, start:stop] = draft_ids[: stop - start]

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        """Append a step's tokens to one row (speculative decoding emits several)."""
        start = int(self.num_tokens[row])
        stop = min(start + len(token_ids), self.token_capacity)
        self.token_ids[row, start:stop] = token_ids[: stop - start]
        self.num_tokens[row] = stop

    def all_plain_greedy(self, rows: np.ndarray) -> bool:
        """Whether these rows' tokens are just the argmax of their logits."""
        return bool(self.sampling.plain_greedy[rows].all())

    def sampling_metadata(
        self, rows: np.ndarray, positions: np.ndarray, vocab_size: int
    ) -> SamplingMetadata:
        """Settings of the given rows, in order, as device tensors; `positions` are the indices
        of the tokens they sample: their draws' counters, and the length of the history their
        penalties read (a verify row of speculative decoding reads the drafts before it)."""
        cols = self.sampling
        temperature = cols.temperature[rows]
        greedy = temperature < GREEDY_TEMPERATURE
        all_greedy = bool(greedy.all())
        num_logprobs = cols.num_logprobs[rows].tolist()
        metadata = SamplingMetadata(
            temperature=None if all_greedy else self._to_device(temperature),
            greedy=None if all_greedy else self._to_device(greedy),
            all_greedy=all_greedy,
            all_random=not bool(greedy.any()),
            penalties=self._penalties(rows, positions, vocab_size),
            logit_bias=self._logit_bias(rows),
            allowed=self._allowed_tokens(rows, vocab_size),
            banned=self._banned_tokens(rows, positions),
            num_logprobs=[None if n < 0 else n for n in num_logprobs],
        )
        if not metadata.all_greedy:
            self._set_filters(metadata, rows, greedy, vocab_size)
            metadata.seeds = self._to_device(self.seeds[rows])
            metadata.positions = self._to_device(positions.astype(np.int64))
        return metadata

    def _set_filters(
        self, metadata: SamplingMetadata, rows: np.ndarray, greedy: np.ndarray, vocab_size: int
    ) -> None:
        top_k = self.sampling.top_k[rows]
        top_k = np.where((top_k <= 0) | greedy, vocab_size, np.minimum(top_k, vocab_size))
        if (top_k < vocab_size).any():
            metadata.top_k = self._to_device(top_k)
        top_p = np.where(greedy, 1.0, self.sampling.top_p[rows]).astype(np.float32)
        if (top_p < 1.0).any():
            metadata.top_p = self._to_device(top_p)
        min_p = np.where(greedy, 0.0, self.sampling.min_p[rows]).astype(np.float32)
        if (min_p > 0.0).any():
            metadata.min_p = self._to_device(min_p)

    def _logit_bias(self, rows: np.ndarray) -> LogitBias | None:
        """The biases of these rows (index i of the step: rows[i]'s), or None without any."""
        if not self.biases:
            return None
        parts = [(i, self.biases[row]) for i, row in enumerate(rows.tolist()) if row in self.biases]
        if not parts:
            return None
        index = np.concatenate([np.full(len(tokens), i, np.int64) for i, (tokens, _) in parts])
        tokens = np.concatenate([tokens for _, (tokens, _) in parts])
        biases = np.concatenate([biases for _, (_, biases) in parts])
        return LogitBias(self._to_device(index), self._to_device(tokens), self._to_device(biases))

    def _allowed_tokens(self, rows: np.ndarray, vocab_size: int) -> AllowedTokens | None:
        """The masks of these rows' allowed_token_ids (index i of the step: rows[i]'s)."""
        if not self.allowed:
            return None
        parts = [
            (i, self.allowed[row]) for i, row in enumerate(rows.tolist()) if row in self.allowed
        ]
        if not parts:
            return None
        local = np.concatenate(
            [np.full(len(tokens), j, np.int64) for j, (_, tokens) in enumerate(parts)]
        )
        tokens = np.concatenate([tokens for _, tokens in parts])
        keep = torch.zeros(len(parts), vocab_size, dtype=torch.bool, device=self.device)
        keep[self._to_device(local), self._to_device(tokens)] = True
        index = np.fromiter((i for i, _ in parts), np.int64, len(parts))
        return AllowedTokens(self._to_device(index), keep)

    def _banned_tokens(self, rows: np.ndarray, lengths: np.ndarray) -> BannedTokens | None:
        """The tokens that would complete one of these rows' bad words after their first
        `lengths` tokens (vLLM's rule: a sequence's last token, where the output so far ends
        with the rest of it; the prompt does not count)."""
        if not self.bad_words:
            return None
        index, tokens = [], []
        for i, row in enumerate(rows.tolist()):
            sequences = self.bad_words.get(row)
            if sequences is None:
                continue
            end = min(int(lengths[i]), self.token_capacity)
            output = self.token_ids[row, int(self.num_prompt_tokens[row]) : end].tolist()
            for sequence in sequences:
                before = len(sequence) - 1
                if before <= len(output) and output[len(output) - before :] == sequence[:-1]:
                    index.append(i)
                    tokens.append(sequence[-1])
        if not index:
            return None
        return BannedTokens(
            self._to_device(np.array(index, np.int64)), self._to_device(np.array(tokens, np.int64))
        )

    def _penalties(
        self, rows: np.ndarray, lengths: np.ndarray, vocab_size: int
    ) -> PenaltyState | None:
        if not self.needs_token_history(rows):
            return None
        cols = self.sampling
        presence, frequency = cols.presence[rows], cols.frequency[rows]
        repetition = cols.repetition[rows]
        output_counts, prompt_mask = self._token_histograms(rows, lengths, vocab_size)
        return PenaltyState(
            presence=self._to_device(presence),
            frequency=self._to_device(frequency),
            repetition=self._to_device(repetition),
            output_counts=output_counts,
            prompt_mask=prompt_mask,
        )

    def _token_histograms(
        self, rows: np.ndarray, lengths: np.ndarray, vocab_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, vocab] counts of each row's output tokens (float32) and its prompt tokens'
        presence (bool), over its first `lengths` tokens."""
        num_tokens = np.minimum(lengths, self.token_capacity)
        width = int(num_tokens.max())
        tokens = self._to_device(self.token_ids[rows, :width]).long()
        columns = torch.arange(width, device=self.device).unsqueeze(0)
        prompt_len = self._to_device(self.num_prompt_tokens[rows]).unsqueeze(1)
        in_prompt = columns < prompt_len
        in_output = ~in_prompt & (columns < self._to_device(num_tokens).unsqueeze(1))
        batch = len(rows)
        counts = torch.zeros(batch, vocab_size + 1, device=self.device)
        counts.scatter_add_(1, torch.where(in_output, tokens, vocab_size), in_output.float())
        mask = torch.zeros(batch, vocab_size + 1, dtype=torch.bool, device=self.device)
        mask.scatter_(1, torch.where(in_prompt, tokens, vocab_size), True)
        return counts[:, :vocab_size], mask[:, :vocab_size]

    def needs_token_history(self, rows: np.ndarray) -> bool:
        """Whether sampling these rows reads their past tokens on the host (penalties, bad
        words)."""
        cols = self.sampling
        return bool(
            cols.presence[rows].any()
            or cols.frequency[rows].any()
            or (cols.repetition[rows] != 1.0).any()
            or (self.bad_words and any(row in self.bad_words for row in rows.tolist()))
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)
