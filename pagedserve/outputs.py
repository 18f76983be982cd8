"""Results of the offline API, shaped like vLLM's `RequestOutput` / `CompletionOutput`,
`EmbeddingRequestOutput` / `EmbeddingOutput`, `ClassificationRequestOutput` /
`ClassificationOutput` and `ScoringRequestOutput` / `ScoringOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedserve.actors.messages import RequestDelta, TokenLogprobs


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: RequestDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = self.logprobs or []
            self.cumulative_logprob = self.cumulative_logprob or 0.0
            for entry in delta.logprobs:
                self.logprobs.append(logprob_dict(entry))
                self.cumulative_logprob += entry.logprob
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason.openai_name
            self.stop_reason = delta.stop_reason


def logprob_dict(entry: TokenLogprobs) -> dict[int, Logprob]:
    """vLLM's per-token shape: the sampled token first, then the top alternatives."""
    out = {entry.token_id: Logprob(entry.logprob, entry.rank)}
    for rank, (token_id, logprob) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), 1):
        out.setdefault(token_id, Logprob(logprob, rank))
    return out


def prompt_logprob_dicts(entries: list[TokenLogprobs | None]) -> list[dict[int, Logprob] | None]:
    return [None if entry is None else logprob_dict(entry) for entry in entries]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: per prompt token (None for the first), as vLLM's
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished() for o in self.outputs)


def embedding_floats(vector: bytes) -> list[float]:
    """An embedding's values from the engine's wire form (little-endian float32 bytes)."""
    return np.frombuffer(vector, dtype="<f4").tolist()


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        """How many values the embedding has (vLLM's name)."""
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (LLM.embed), vLLM's shape."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's score (LLM.score), vLLM's shape: an embedding model's joins the two
    embeddings' ids, its prompt_token_ids both texts' tokens, one after the other; a
    cross-encoder's has its pair's one request id and sequence."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool


@dataclass
class ClassificationOutput:
    probs: list[float]  # one a label, in label order (api/classification.py: vLLM's softmax)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """One prompt's classification (LLM.classify), vLLM's shape."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool
