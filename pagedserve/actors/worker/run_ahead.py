"""Rounds of n-gram speculation that verify no drafts, pipelined as plain decode steps are.

With rounds (SpeculativeConfig.num_rounds > 1) the worker verifies its own proposals again before
it reports (verify_step.py), and the host's loop syncs at the end of every round to read its
tokens and look the next drafts up. A round without drafts (the request left the text its
n-grams match) is a one-token decode step; synced, it cost ~0.57 ms on an H100 with the ~94M
target where a pipelined plain step costs ~0.40 ms (scripts/results/session33.md). So such rounds
run ahead: the next round's decode is queued, fed its token from the device's samples (the
argmax the decode graph writes into `sampled`: plain greedy requests only), before the host
reads this round's tokens, from a copy queued behind the decode (the runner's SampledIds: no
step is in flight beside a speculative one), and looks drafts up.
A round whose lookup proposes ends the run after the round run ahead of it, whose lookup then
proposes the next verify's drafts; so does a request without room for another token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedserve.actors.messages import StepResult
from pagedserve.actors.worker.speculative import NgramProposer

if TYPE_CHECKING:
    from pagedserve.actors.worker.model_runner import ModelRunner


def runs_ahead(runner: ModelRunner, rows: np.ndarray) -> bool:
    """Whether rounds without drafts may run ahead: n-gram proposals (looked up on the host's
    tokens) and plain greedy requests (the next decode step can be fed their samples)."""
    return isinstance(runner.proposer, NgramProposer) and runner.input_batch.all_plain_greedy(rows)


def undrafted_rounds(
    runner: ModelRunner, rows: np.ndarray, most: int, finish: Callable[[list[int]], StepResult]
) -> list[StepResult]:
    """Up to `most` rounds that verify no drafts, each a decode step of one token a request;
    finish(tokens) accepts a round's tokens (one a request) and proposes the next drafts."""
    count, to_host = len(rows), runner.sampled_ids.copy
    tokens = _decode_one(runner, rows, np.full(count, -1, np.int64))
    results: list[StepResult] = []
    while True:  # round r's copy goes to slot r % 2, read before slot r + 2's copy
        ahead = len(results) + 2 <= most and bool((rooms(runner, rows) >= 1).all())
        copied = to_host(tokens, len(results))  # before a decode run ahead overwrites `sampled`
        if ahead:
            tokens = _decode_one(runner, rows, np.arange(count, dtype=np.int64))
        results.append(finish(_read(copied)))
        if not ahead:
            return results
        if any(results[-1].draft_token_ids):  # drafting resumes after the round run ahead
            results.append(finish(_read(to_host(tokens, len(results)))))
            return results


def rooms(runner: ModelRunner, rows: np.ndarray) -> np.ndarray:
    """Per request of `rows`: how many tokens it may still add past its next one (the KV
    blocks it holds, its length limit: max_tokens, the model's length); below 0 when it has
    no room for even its next one (it has ended)."""
    batch, max_len = runner.input_batch, runner.config.max_model_len
    assert max_len is not None
    num_tokens = batch.num_tokens[rows]
    capacity = batch.num_blocks[rows] * runner.block_size
    limit = np.minimum(batch.length_limit[rows], max_len)
    return np.minimum(capacity - num_tokens, limit - 1 - num_tokens)


def _decode_one(runner: ModelRunner, rows: np.ndarray, feed_index: np.ndarray) -> torch.Tensor:
    """Queue one token of each request (its last known one, or with feed_index >= 0 the one
    at that index of the last decode's samples) as a decode step; its samples on the device."""
    batch = runner.input_batch
    positions = batch.num_computed_tokens[rows].copy()
    batch.num_computed_tokens[rows] = positions + 1
    decoded = runner.run_decode(rows, positions, feed_index)
    assert decoded is not None, "speculative decoding runs without pipeline stages"
    return decoded[0]


def _read(copied: tuple[torch.Tensor, torch.cuda.Event | None]) -> list[int]:
    """The ids of a copy made by the runner's SampledIds, once it has run."""
    host, done = copied
    if done is not None:
        done.synchronize()
    return host.tolist()
