"""pagedserve: a small, fast LLM inference and serving engine.

Names are imported lazily so that actor processes, which import submodules only, start fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.actors.messages import LoRARequest
    from pagedserve.actors.pooling_params import PoolingParams
    from pagedserve.actors.sampling_params import SamplingParams, StructuredOutputsParams
    from pagedserve.api.beam_search import BeamSearchParams
    from pagedserve.api.llm import LLM
    from pagedserve.config import EngineConfig, ProfileConfig
    from pagedserve.outputs import (
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        Logprob,
        RequestOutput,
        ScoringOutput,
        ScoringRequestOutput,
    )

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "PoolingParams",
    "BeamSearchParams",
    "LoRARequest",
    "EngineConfig",
    "ProfileConfig",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "EmbeddingRequestOutput",
    "EmbeddingOutput",
    "ScoringRequestOutput",
    "ScoringOutput",
]
__version__ = "0.1.0"

_HOMES = {
    "LLM": "pagedserve.api.llm",
    "SamplingParams": "pagedserve.actors.sampling_params",
    "StructuredOutputsParams": "pagedserve.actors.sampling_params",
    "PoolingParams": "pagedserve.actors.pooling_params",
    "BeamSearchParams": "pagedserve.api.beam_search",
    "LoRARequest": "pagedserve.actors.messages",
    "EngineConfig": "pagedserve.config",
    "ProfileConfig": "pagedserve.config",
    "RequestOutput": "pagedserve.outputs",
    "CompletionOutput": "pagedserve.outputs",
    "Logprob": "pagedserve.outputs",
    "EmbeddingRequestOutput": "pagedserve.outputs",
    "EmbeddingOutput": "pagedserve.outputs",
    "ScoringRequestOutput": "pagedserve.outputs",
    "ScoringOutput": "pagedserve.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
