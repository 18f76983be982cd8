"""PoolingParams, part of the wire schema (messages.py re-exports it): what a pooling request
(an embedding, a classification) asks of its pooled vector, vLLM's names. Checked when built
(a ValueError is a 400 at the API). Rules as in messages.py: add fields only at the end."""

from __future__ import annotations

import msgspec

from pagedserve.actors.sampling_params import SamplingParams

POOLING_TASKS = ("embed", "classify")  # vLLM's names


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's PoolingParams: `dimensions` keeps an embedding's first that many values
    (Matryoshka embeddings; at most the model's hidden size), before it is normalized;
    `normalize` None: as the engine's pooler_config says (EngineConfig.pooler_config). `task`
    (vLLM's): "embed" (None means it too) or "classify", the labels' logits of a sequence
    classifier; the engine refuses a task its model does not serve."""

    dimensions: int | None = None
    normalize: bool | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and not 1 <= self.dimensions < 2**63:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.task == "classify" and (self.dimensions is not None or self.normalize):
            raise ValueError("dimensions and normalize are an embedding's, not a classification's")


def pooling_sampling(truncate_prompt_tokens: int | None = None) -> SamplingParams:
    """The SamplingParams that go with a pooling request: its prompt's settings (the engine
    samples nothing for it)."""
    return SamplingParams(
        temperature=0.0, max_tokens=1, truncate_prompt_tokens=truncate_prompt_tokens
    )
