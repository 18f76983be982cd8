"""Pooling requests in the worker (embeddings: PoolingParams): a prompt's final hidden states
(the model's output after its final norm, before the LM head) pooled into one vector, by the
steps that run the prompt; each chunk of a chunked prefill pools its own positions.

Rows. The engine's pooling type (EngineConfig.pooler_config) says which positions a request
needs: LAST its last prompt token, CLS position 0, MEAN every prompt position. A step that
computes positions [c, c + q) of a pooling request runs those among them through the last
layer after its sampling and prompt-logprob rows (StepInputs.pooling: the last-layer narrowing
keeps them), and sums each request's rows in float32. MEAN adds the chunk's sum to what the
request's earlier chunks pooled (kept in the persistent batch, `pooled_so_far`), CLS keeps
position 0's row until the prompt ends. The step that computes the prompt's last token makes
the vector (MEAN: the sum over the prompt's length); `to_wire` keeps its first `dimensions`
values, normalizes it unless the request or the engine says not to, and gives it as
little-endian float32 bytes (StepResult.pooled). A sequence classifier's vector goes through
the model's score head instead (`Pooler.head`): its labels' logits, neither cut nor normalized
(the API turns them into probabilities: api/classification.py). A pooling request never
samples: the scheduler finishes it with its vector (scheduler/pooling.py).

The static paths (decode rows, the lone-prompt graphs) produce no hidden states to pool: a step
with a pooling request takes the general path. The scheduler gives MEAN and CLS requests no
prefix-cache hit (its positions would never run); a request preempted, or sent again to
restarted workers, arrives anew and pools from its first position (the persistent batch
forgets what a removed request pooled).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.actors.worker.input_batch import InputBatch
from pagedserve.config import PoolerConfig

NORM_EPS = 1e-12  # torch.nn.functional.normalize's: a zero vector stays zero


@dataclass
class PoolingRows:
    """A step's pooling requests and the rows whose final hidden states they need (in request
    order, after the step's other logits rows)."""

    token_index: np.ndarray  # [R] each row's index among the step's tokens
    request_index: np.ndarray  # [R] the index of its request among the step's requests
    positions: np.ndarray  # [R] the position it computes
    handles: list[int]  # the step's pooling requests
    rows: list[int]  # their persistent-batch rows
    counts: list[int]  # the rows of each
    finishes: list[bool]  # whether the step computes its prompt's last token


@dataclass
class PooledVectors:
    """The vectors of the requests whose prompts a step ends, on the device until `to_wire`."""

    handles: list[int]
    vectors: torch.Tensor  # [F, hidden] float32
    dimensions: list[int | None]  # how many values of each to keep (None: all)
    normalize: list[bool]

    def to_wire(self) -> dict[int, bytes]:
        wire = {}
        vectors = self.vectors.cpu().numpy()
        for handle, vector, dimensions, normalize in zip(
            self.handles, vectors, self.dimensions, self.normalize
        ):
            vector = vector[:dimensions]
            if normalize:
                vector = vector / max(float(np.linalg.norm(vector)), NORM_EPS)
            wire[handle] = vector.astype("<f4").tobytes()
        return wire


class Pooler:
    """The engine's pooling (a resolved PoolerConfig) over the persistent batch's pooling
    requests."""

    def __init__(self, config: PoolerConfig, batch: InputBatch) -> None:
        assert config.pooling_type is not None and config.normalize is not None, "resolve() it"
        self.pooling_type, self.normalize, self.batch = config.pooling_type, config.normalize, batch
        # a sequence classifier's head over the pooled vectors (set by ModelRunner.load_model):
        # [N, hidden] -> [N, num_labels] logits; None: the vectors are embeddings
        self.head: Callable[[torch.Tensor], torch.Tensor] | None = None

    def select_rows(
        self, handles: list[int], rows: np.ndarray, computed: np.ndarray, query_lens: np.ndarray
    ) -> PoolingRows | None:
        """The step's pooling rows, given its requests (handles, persistent-batch rows, the
        tokens each had computed before the step and computes in it); None without any."""
        if not self.batch.pooling:  # the usual step: none in the whole batch
            return None
        pools = self.batch.pools[rows]
        if not pools.any():
            return None
        finishes = pools & (computed + query_lens >= self.batch.num_prompt_tokens[rows])
        first, counts = self._chunk_rows(pools, finishes, computed, query_lens)
        request_index = np.repeat(np.arange(len(rows)), counts)
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        offsets = first[request_index] + within
        query_starts = np.cumsum(query_lens) - query_lens
        pooling = np.flatnonzero(pools)
        return PoolingRows(
            token_index=query_starts[request_index] + offsets,
            request_index=request_index,
            positions=computed[request_index] + offsets,
            handles=[handles[i] for i in pooling.tolist()],
            rows=rows[pooling].tolist(),
            counts=counts[pooling].tolist(),
            finishes=finishes[pooling].tolist(),
        )

    def _chunk_rows(
        self, pools: np.ndarray, finishes: np.ndarray, computed: np.ndarray, query_lens: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per request of the step: the offset in its chunk of its first pooling row, and how
        many it has (0 for a request that does not pool)."""
        if self.pooling_type == "MEAN":
            return np.zeros_like(query_lens), np.where(pools, query_lens, 0)
        if self.pooling_type == "CLS":
            return np.zeros_like(query_lens), (pools & (computed == 0)).astype(np.int64)
        return query_lens - 1, finishes.astype(np.int64)  # LAST

    def pool(self, hidden: torch.Tensor, rows: PoolingRows) -> PooledVectors | None:
        """hidden: [R, hidden] the final hidden states of `rows`, in order. What an unfinished
        prompt pooled is kept for its next chunk; the vectors of the finished ones (None:
        no prompt ends in this step). Each request's rows are summed by one index_add for the
        whole step."""
        batch = self.batch
        counts = np.asarray(rows.counts, dtype=np.int64)
        segments = torch.from_numpy(np.repeat(np.arange(len(counts)), counts))
        sums = torch.zeros(len(counts), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, segments.to(hidden.device), hidden[: int(counts.sum())].float())
        finished: list[int] = []
        vectors: list[torch.Tensor] = []
        for index, (row, count) in enumerate(zip(rows.rows, rows.counts)):
            if not count and not rows.finishes[index]:
                continue  # nothing of it in this chunk (LAST before its end, CLS after 0)
            pooled = self._combine(batch.pooled_so_far.pop(row, None), sums[index])
            if not rows.finishes[index]:
                if self.pooling_type != "LAST":
                    batch.pooled_so_far[row] = pooled
                continue
            finished.append(index)
            vectors.append(pooled)
        if not finished:
            return None
        stacked = torch.stack(vectors)
        if self.pooling_type == "MEAN":
            lengths = batch.num_prompt_tokens[[rows.rows[i] for i in finished]]
            stacked /= torch.from_numpy(lengths.astype(np.float32)).to(stacked.device)[:, None]
        params = [batch.pooling[rows.rows[i]] for i in finished]
        handles = [rows.handles[i] for i in finished]
        if self.head is not None:  # a classifier's vector: its labels' logits, as they are
            return PooledVectors(
                handles, self.head(stacked), [None] * len(params), [False] * len(params)
            )
        return PooledVectors(
            handles=handles,
            vectors=stacked,
            dimensions=[p.dimensions for p in params],
            normalize=[self.normalize if p.normalize is None else p.normalize for p in params],
        )

    def _combine(self, so_far: torch.Tensor | None, chunk: torch.Tensor) -> torch.Tensor:
        """What a request has pooled after this chunk (MEAN: a sum; CLS: position 0's row)."""
        if so_far is None or self.pooling_type == "LAST":
            return chunk
        return so_far + chunk if self.pooling_type == "MEAN" else so_far
