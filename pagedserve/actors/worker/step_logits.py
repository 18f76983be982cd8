"""What a step does with its logits rows (StepInputs.logits_indices): the sampling rows get
their grammar masks (structured.py) and are sampled; the prompt rows give prompt logprobs
(prompt_logprobs.py).

Grammar masks need every token before the positions they sample, so a step with constrained
requests finishes the step in flight (`settle`, the runner's) once its own forward is queued:
the host advances the matchers and computes the masks while the device runs the forward.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedserve.actors.worker import prompt_logprobs
from pagedserve.actors.worker.input_batch import InputBatch
from pagedserve.actors.worker.prompt_logprobs import PromptLogprobTensors
from pagedserve.actors.worker.sampler import Sampler, SamplerOutput
from pagedserve.actors.worker.step_inputs import StepInputs
from pagedserve.actors.worker.structured import StructuredOutputs


class StepLogits:
    def __init__(
        self,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        batch: InputBatch,
        sampler: Sampler,
        structured: StructuredOutputs,
        settle: Callable[[], None],
    ) -> None:
        self.compute_logits, self.batch, self.sampler = compute_logits, batch, sampler
        self.structured, self.settle = structured, settle
        self.vocab_size = structured.vocab_size

    @staticmethod
    def hidden_rows(hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """The final hidden states of the step's logits rows (sampling, then prompt)."""
        if inputs.attn_metadata.output_rows is None:  # else hidden holds just those rows
            hidden = hidden.index_select(0, inputs.logits_indices)
        return hidden

    def sample(
        self, hidden: torch.Tensor, inputs: StepInputs, drafts: list[list[int]] | None = None
    ) -> SamplerOutput:
        """Sample the sampling rows (the first rows of `hidden_rows`); `drafts`: each
        sampling request's drafts (speculative decoding: one mask per verified position)."""
        logits = self.compute_logits(hidden[: len(inputs.sampling_rows)])
        counts = inputs.sampling_counts
        logits = self.constrain(logits, inputs.sampling_rows[np.cumsum(counts) - counts], drafts)
        metadata = self.batch.sampling_metadata(
            inputs.sampling_rows, inputs.sampling_positions, self.vocab_size
        )
        return self.sampler(logits, metadata)

    def constrain(
        self, logits: torch.Tensor, rows: np.ndarray, drafts: list[list[int]] | None = None
    ) -> torch.Tensor:
        """The logits of `rows` (persistent-batch rows, in order) with their grammar masks."""
        if not self.structured.constrains(rows):
            return logits
        self.settle()
        return self.structured.apply(logits, rows, drafts)

    def prompt_logprobs(
        self, hidden: torch.Tensor, inputs: StepInputs
    ) -> PromptLogprobTensors | None:
        """The prompt rows' logprobs (the last rows of `hidden_rows`), on the device."""
        rows = inputs.prompt_logprobs
        if rows is None:
            return None
        prompt_hidden = hidden[len(inputs.sampling_rows) :]
        return prompt_logprobs.compute(self.compute_logits, prompt_hidden, rows)
