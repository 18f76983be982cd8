"""PoolingParams, part of the wire schema (messages.py re-exports it): what an embeddings
request asks of its pooled vector, vLLM's names. Checked when built (a ValueError is a 400 at
the API). Rules as in messages.py: add fields only at the end."""

from __future__ import annotations

import msgspec

from pagedserve.actors.sampling_params import SamplingParams


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's PoolingParams of an embedding: `dimensions` keeps the vector's first that many
    values (Matryoshka embeddings; at most the model's hidden size), before it is normalized;
    `normalize` None: as the engine's pooler_config says (EngineConfig.pooler_config)."""

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and not 1 <= self.dimensions < 2**63:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")


def pooling_sampling(truncate_prompt_tokens: int | None = None) -> SamplingParams:
    """The SamplingParams that go with a pooling request: its prompt's settings (the engine
    samples nothing for it)."""
    return SamplingParams(
        temperature=0.0, max_tokens=1, truncate_prompt_tokens=truncate_prompt_tokens
    )
