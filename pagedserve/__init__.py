"""pagedserve: a small, fast LLM inference and serving engine."""

from pagedserve.actors.messages import SamplingParams
from pagedserve.api.llm import LLM
from pagedserve.config import EngineConfig
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
