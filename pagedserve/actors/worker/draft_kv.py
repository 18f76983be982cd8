"""Which tokens a draft model's KV cache holds, and its catch-up after steps without speculation.

A step that does not speculate (disable_by_batch_size) is a plain step: the draft does not run.
Its KV then lags behind the target's, and catches up lazily, at the next speculative step of
the request, in one eager forward of the draft over the tokens it missed (a request speculated
on again usually missed many steps, so one forward of them all costs far less than a draft
decode in each of them).

Per persistent-batch row, `length`: tokens [0, length) of the row hold the draft's KV (set at
the end of each speculative step to the row's computed tokens: there the draft read every
token the target computed, or wrote it in its chain). Per KV block, `full`: the block holds the
draft's KV of all its tokens, so that a request that hits it in the prefix cache knows how much
of its prefix the draft has. A block is not full from when it is handed to a request (its new
blocks in a plan) until the draft's KV covers it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedserve.actors.messages import StepPlan
from pagedserve.actors.worker.input_batch import InputBatch
from pagedserve.actors.worker.step_inputs import StepInputBuilder, StepInputs


class DraftCoverage:
    def __init__(self, max_rows: int, num_blocks: int, block_size: int) -> None:
        self.length = np.zeros(max_rows, np.int64)
        self.full = np.zeros(num_blocks, bool)
        self.block_size = block_size

    def track(self, plan: StepPlan, batch: InputBatch) -> None:
        """A plan's new requests (what their prefix-cache hit holds of the draft's KV) and new
        blocks, once the plan is applied to the batch."""
        bs = self.block_size
        for new in plan.new_requests:
            hit = new.num_computed_tokens // bs
            held = self.full[new.block_ids[:hit]]
            leading = hit if held.all() else int(np.argmin(held))
            self.length[batch.row_of[new.handle]] = min(leading * bs, new.num_computed_tokens)
            self.full[new.block_ids[hit:]] = False
        new_blocks = plan.cached_requests.new_block_ids
        if new_blocks:
            self.full[new_blocks] = False

    def catch_up(
        self,
        inputs: StepInputBuilder,
        forward: Callable[[StepInputs], None],
        handles: list[int],
        rows: np.ndarray,
    ) -> None:
        """Before a speculative step of `rows`: run the draft (`forward`) over the tokens the
        target computed without it, [length, num_computed) of each row behind."""
        batch = inputs.batch
        computed = batch.num_computed_tokens[rows]
        behind = np.flatnonzero(self.length[rows] < computed)
        if not len(behind):
            return
        lagging = rows[behind]
        batch.num_computed_tokens[lagging] = self.length[lagging]  # build() advances it back
        missed = (computed[behind] - self.length[lagging]).tolist()
        step = inputs.build(
            [handles[i] for i in behind.tolist()], missed, lagging,
            np.full(len(lagging), -1, np.int64), np.zeros(len(lagging), np.int64),
        )  # fmt: skip
        with torch.inference_mode():
            forward(step)

    def covered(self, batch: InputBatch, rows: np.ndarray) -> None:
        """After a speculative step of `rows`: the draft holds their computed tokens' KV."""
        bs, old = self.block_size, self.length[rows]
        new = batch.num_computed_tokens[rows]
        self.length[rows] = new
        for i in np.flatnonzero(new // bs > old // bs).tolist():  # blocks it has now filled
            row = int(rows[i])
            self.full[batch.block_table_np[row, old[i] // bs : new[i] // bs]] = True
