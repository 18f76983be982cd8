"""Prompt logprobs in the worker (SamplingParams.prompt_logprobs): the logprob of each prompt
token given the tokens before it, with its rank and the top-k alternatives, computed by the
steps that run the prompt (each chunk of a chunked prefill computes its own positions).

Rows. A request that wants them and computes positions [c, c + q) in a step needs the logits
of positions p in [c, min(c + q, P - 1)), P its prompt length: they predict prompt token p + 1
(the first prompt token has none; position P - 1 predicts the first output token, which the
sampler handles). The step's last layer runs these rows after its sampling rows
(StepInputs.prompt_logprobs), and their logits are computed LOGITS_CHUNK rows at a time, so a
long prompt never holds a [prompt, vocab] float32 tensor. The results stay on the device until
the step finishes (`to_wire`).

The scheduler skips the prefix cache for these requests (a cached block's positions are never
run, so they would have no logits); a request recomputed after preemption computes them again
and the scheduler keeps the first copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.actors.messages import PromptLogprobs, TokenLogprobs
from pagedserve.actors.worker.input_batch import InputBatch

LOGITS_CHUNK = 256  # prompt rows whose logits exist at once


@dataclass
class PromptLogprobRows:
    """A step's rows whose logits give prompt logprobs, in request order."""

    token_index: np.ndarray  # [R] each row's index among the step's tokens
    request_index: np.ndarray  # [R] the index of its request among the step's requests
    positions: np.ndarray  # [R] the position it computes (its logits predict position + 1)
    target_ids: np.ndarray  # [R] the prompt token at position + 1
    num_logprobs: np.ndarray  # [R] top alternatives its request wants
    chunks: list[tuple[int, int, int]]  # per request: (handle, its first prompt index, rows)


def select_rows(
    batch: InputBatch,
    handles: list[int],
    rows: np.ndarray,
    computed: np.ndarray,
    query_lens: np.ndarray,
) -> PromptLogprobRows | None:
    """The step's prompt-logprob rows, given its requests (handles, persistent-batch rows, the
    tokens each had computed before the step and computes in it); None when none wants any."""
    num_logprobs = batch.sampling.num_prompt_logprobs[rows]
    if (num_logprobs < 0).all():
        return None
    ends = np.minimum(computed + query_lens, batch.num_prompt_tokens[rows] - 1)
    counts = np.where(num_logprobs >= 0, np.maximum(ends - computed, 0), 0)
    if not counts.any():
        return None
    request_index = np.repeat(np.arange(len(handles)), counts)
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    query_starts = np.cumsum(query_lens) - query_lens
    positions = computed[request_index] + offsets
    return PromptLogprobRows(
        token_index=query_starts[request_index] + offsets,
        request_index=request_index,
        positions=positions,
        target_ids=batch.token_ids[rows[request_index], positions + 1].astype(np.int64),
        num_logprobs=num_logprobs[request_index],
        chunks=[(handles[i], int(computed[i]) + 1, int(counts[i])) for i in np.flatnonzero(counts)],
    )


@dataclass
class PromptLogprobTensors:
    """A step's prompt logprobs, still on the device (no host sync until `to_wire`)."""

    rows: PromptLogprobRows
    token_logprobs: torch.Tensor  # [R]
    ranks: torch.Tensor  # [R]: 1 = the most likely token
    top_logprobs: torch.Tensor | None  # [R, max k] (None: no request wants alternatives)
    top_ids: torch.Tensor | None

    def to_wire(self) -> list[PromptLogprobs]:
        rows = self.rows
        token_logprobs, ranks = self.token_logprobs.tolist(), self.ranks.tolist()
        top_values = top_ids = [[] for _ in token_logprobs]
        if self.top_logprobs is not None and self.top_ids is not None:
            top_values, top_ids = self.top_logprobs.tolist(), self.top_ids.tolist()
        entries = [
            TokenLogprobs(int(target), lp, rank, ids[:k], values[:k])
            for target, lp, rank, ids, values, k in zip(
                rows.target_ids, token_logprobs, ranks, top_ids, top_values,
                rows.num_logprobs.tolist(),
            )
        ]  # fmt: skip
        out, start = [], 0
        for handle, first, count in rows.chunks:
            out.append(PromptLogprobs(handle, first, entries[start : start + count]))
            start += count
        return out


def compute(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    rows: PromptLogprobRows,
) -> PromptLogprobTensors:
    """hidden: [R, hidden] the final hidden states of `rows`, in order."""
    targets = torch.from_numpy(rows.target_ids)
    if hidden.is_cuda:  # a pageable copy could wait for the device's queue to drain
        targets = targets.pin_memory().to(hidden.device, non_blocking=True)
    max_k = int(rows.num_logprobs.max())
    token_lps, ranks, top_lps, top_ids = [], [], [], []
    for start in range(0, hidden.shape[0], LOGITS_CHUNK):
        stop = start + LOGITS_CHUNK
        logprobs = torch.log_softmax(compute_logits(hidden[start:stop]).float(), dim=-1)
        token_lp = logprobs.gather(1, targets[start:stop].unsqueeze(1))
        token_lps.append(token_lp.squeeze(1))
        ranks.append((logprobs >= token_lp).sum(dim=-1))
        if max_k:
            values, ids = logprobs.topk(max_k, dim=-1)
            top_lps.append(values)
            top_ids.append(ids)
    return PromptLogprobTensors(
        rows, torch.cat(token_lps), torch.cat(ranks),
        torch.cat(top_lps) if max_k else None, torch.cat(top_ids) if max_k else None,
    )  # fmt: skip
