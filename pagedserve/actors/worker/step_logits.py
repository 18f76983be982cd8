"""What a step does with its logits rows (StepInputs.logits_indices): the sampling rows get
their grammar masks (structured.py), for the runner's sampler; the prompt rows give prompt
logprobs (prompt_logprobs.py).

Grammar masks need every token before the positions they sample, so a step with constrained
requests finishes the step in flight (`settle`, the runner's) once its own forward is queued:
the host advances the matchers and computes the masks while the device runs the forward.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedserve.actors.worker import prompt_logprobs
from pagedserve.actors.worker.prompt_logprobs import PromptLogprobTensors
from pagedserve.actors.worker.step_inputs import StepInputs
from pagedserve.actors.worker.structured import StructuredOutputs


class StepLogits:
    def __init__(
        self,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        structured: StructuredOutputs,
        settle: Callable[[], None],
    ) -> None:
        self.compute_logits, self.structured, self.settle = compute_logits, structured, settle

    def run(
        self, hidden: torch.Tensor, inputs: StepInputs
    ) -> tuple[torch.Tensor | None, PromptLogprobTensors | None]:
        """The sampling rows' logits, masked (None: no request samples), and the prompt
        logprobs (None: none asked for), from the model's final hidden states."""
        if inputs.attn_metadata.output_rows is None:  # else hidden holds just the logits rows
            hidden = hidden.index_select(0, inputs.logits_indices)
        num_sampling = len(inputs.sampling_rows)
        prompt = None
        if inputs.prompt_logprobs is not None:  # their rows follow the sampling rows
            prompt = prompt_logprobs.compute(
                self.compute_logits, hidden[num_sampling:], inputs.prompt_logprobs
            )
        if not inputs.sampling_handles:
            return None, prompt
        logits = self.compute_logits(hidden[:num_sampling])
        return self.constrain(logits, inputs.sampling_rows), prompt

    def constrain(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """The logits (one row per entry of `rows`, persistent-batch rows) with the grammar
        masks of the constrained ones (which never have drafts: one logits row each)."""
        if not self.structured.constrains(rows):
            return logits
        self.settle()
        return self.structured.apply(logits, rows)
