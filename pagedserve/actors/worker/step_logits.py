"""What a step does with the rows its last layer runs (StepInputs.logits_indices): the sampling
rows get their logits and grammar masks (structured.py), for the runner's sampler; the prompt
rows give prompt logprobs (prompt_logprobs.py); the pooling rows' hidden states give pooled
vectors (pooling.py).

Grammar masks need every token before the positions they sample, so a step with constrained
requests finishes the step in flight (`settle`, the runner's) once its own forward is queued:
the host advances the matchers and computes the masks while the device runs the forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from pagedserve.actors.worker import prompt_logprobs
from pagedserve.actors.worker.pooling import PooledVectors, Pooler
from pagedserve.actors.worker.prompt_logprobs import PromptLogprobTensors
from pagedserve.actors.worker.step_inputs import StepInputs
from pagedserve.actors.worker.structured import StructuredOutputs


class RowOutputs(NamedTuple):
    """The sampling rows' logits, masked (None: no request samples), the prompt logprobs and
    the pooled vectors (None: none asked for, or no prompt pooled ends)."""

    logits: torch.Tensor | None
    prompt_logprobs: PromptLogprobTensors | None
    pooled: PooledVectors | None


class StepLogits:
    def __init__(
        self,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        structured: StructuredOutputs,
        settle: Callable[[], None],
        pooler: Pooler,
    ) -> None:
        self.compute_logits, self.structured, self.settle = compute_logits, structured, settle
        self.pooler = pooler

    def run(self, hidden: torch.Tensor, inputs: StepInputs) -> RowOutputs:
        """What the rows give, from the model's final hidden states."""
        if inputs.attn_metadata.output_rows is None:  # else hidden holds just the logits rows
            hidden = hidden.index_select(0, inputs.logits_indices)
        num_sampling = len(inputs.sampling_rows)
        pooling_start = num_sampling + inputs.num_prompt_logprob_rows
        prompt = pooled = None
        if inputs.prompt_logprobs is not None:  # their rows follow the sampling rows
            prompt = prompt_logprobs.compute(
                self.compute_logits, hidden[num_sampling:pooling_start], inputs.prompt_logprobs
            )
        if inputs.pooling is not None:  # and the pooling rows follow those
            pooled = self.pooler.pool(hidden[pooling_start:], inputs.pooling)
        if not inputs.sampling_handles:
            return RowOutputs(None, prompt, pooled)
        logits = self.compute_logits(hidden[:num_sampling])
        return RowOutputs(self.constrain(logits, inputs.sampling_rows), prompt, pooled)

    def constrain(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """The logits (one row per entry of `rows`, persistent-batch rows) with the grammar
        masks of the constrained ones (which never have drafts: one logits row each)."""
        if not self.structured.constrains(rows):
            return logits
        self.settle()
        return self.structured.apply(logits, rows)
