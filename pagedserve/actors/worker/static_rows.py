"""A step as rows of the static decode path (cuda_graphs.py): every scheduled token is one row.

A request computing T tokens from position n runs T rows at positions n .. n + T - 1 with
n + 1 .. n + T keys on its block table: the layer writes every row's k/v before attending, so
the decode kernels give each row causal attention over the request's context and its earlier
rows, and the step replays a decode graph instead of launching the prefill path eagerly (the
launches of a short prompt's prefill cost far more host time than its device work). A decode
step is the case T = 1. Only the last row of a request whose tokens reach the end of what the
worker knows samples; the others' logits are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedserve.actors.worker.input_batch import InputBatch
from pagedserve.actors.worker.step_inputs import check_plan_fits


@dataclass
class StaticRows:
    rows: np.ndarray  # persistent-batch row of each step row (a request repeats)
    positions: np.ndarray
    feed_index: np.ndarray  # index of the row's token in the step in flight's samples, or -1
    sampling: np.ndarray | None  # the step rows that sample (None: every row samples)
    samples: np.ndarray  # [requests] bool: the request samples


def static_rows(
    batch: InputBatch,
    rows: np.ndarray,
    num_scheduled: list[int],
    pending_index: np.ndarray,
    block_size: int,
) -> StaticRows:
    """The step rows of requests `rows` computing num_scheduled tokens each; advances their
    num_computed_tokens. pending_index[i]: the index of request i's token in the step in
    flight (-1: none), a token the host does not know yet (its row is fed on the device)."""
    counts = np.asarray(num_scheduled, np.int64)
    computed, num_tokens = batch.num_computed_tokens[rows], batch.num_tokens[rows]
    known = num_tokens + (pending_index >= 0)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    positions = np.repeat(computed, counts) + within
    expanded = np.repeat(rows, counts)
    check_plan_fits(batch, expanded, positions + 1, np.repeat(known, counts), block_size)
    in_flight = positions == np.repeat(num_tokens, counts)
    feed = np.where(in_flight, np.repeat(pending_index, counts), -1)
    batch.num_computed_tokens[rows] = computed + counts
    samples = computed + counts >= known
    sampling = None
    if not (samples.all() and (counts == 1).all()):
        sampling = (np.cumsum(counts) - 1)[samples]
    return StaticRows(expanded, positions, feed, sampling, samples)
