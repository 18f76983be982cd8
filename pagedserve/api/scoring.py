"""Scores of text pairs (vLLM's score and rerank APIs), one text against many (1 -> N) or two
lists pair by pair (N -> N). Shared by `LLM.score` and the server's /score and /rerank.

- An embedding model is a bi-encoder: each distinct text is embedded once, and a pair's score
  is the cosine similarity of its two texts' embeddings.
- A sequence classifier is a cross-encoder: each pair is one sequence (a text pair, which the
  engine's tokenizer encodes as vLLM does: `tokenizer.encode_pair`; token ids, joined)
  classified through the score head, and its score is the sigmoid of its one logit (vLLM's:
  a classifier of more labels gives no score)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from pagedserve.actors.pooling_params import PoolingParams
from pagedserve.api.classification import sigmoid
from pagedserve.models.model_config import class_labels, is_sequence_classifier

TextPrompt = str | list[int]  # a text, or its token ids
ScorePrompt = str | list[int] | tuple[str, str]  # what is pooled: a text, ids, or a text pair
NORM_EPS = 1e-8  # as torch's cosine_similarity (vLLM's): a zero vector scores 0


@dataclass(frozen=True)
class ScorePlan:
    """The prompts to pool, each once, and for each pair (in the second list's order) the
    prompts whose pooled vectors make its score: a bi-encoder's two embedded texts, or a
    cross-encoder's one pair sequence, whose vector is the score head's logit."""

    prompts: list[ScorePrompt]
    pairs: list[tuple[int, ...]]
    cross_encoder: bool = False

    def pooling(self) -> PoolingParams:
        """What the engine makes of each prompt: an embedding, or the classifier's logits."""
        return PoolingParams(task="classify") if self.cross_encoder else PoolingParams()

    def scores(self, pooled: Sequence[bytes]) -> list[float]:
        """Each pair's score, from the prompts' pooled vectors (the engine's little-endian
        float32 bytes, in prompt order)."""
        vectors = [np.frombuffer(vector, dtype="<f4") for vector in pooled]
        if self.cross_encoder:
            return [float(sigmoid(vectors[index][0])) for (index,) in self.pairs]
        return [cosine_similarity(vectors[a], vectors[b]) for a, b in self.pairs]


def plan_scores(
    first: Sequence[TextPrompt],
    second: Sequence[TextPrompt],
    names: tuple[str, str],
    hf_config: dict[str, Any],
) -> ScorePlan:
    """The plan that pairs `first` (one text, or as many as `second`) with `second`, for the
    model of `hf_config`; a ValueError names the lists (`names`) when they do not pair."""
    pairs = paired(first, second, names)
    if is_sequence_classifier(hf_config):
        check_cross_encoder(hf_config)
        prompts = [pair_prompt(a, b) for a, b in pairs]
        return ScorePlan(prompts, [(index,) for index in range(len(prompts))], True)
    return bi_encoder_plan(pairs)


def paired(
    first: Sequence[TextPrompt], second: Sequence[TextPrompt], names: tuple[str, str]
) -> list[tuple[TextPrompt, TextPrompt]]:
    check_pairing(len(first), len(second), names)
    if len(first) == 1:
        first = [first[0]] * len(second)
    return list(zip(first, second))


def bi_encoder_plan(pairs: list[tuple[TextPrompt, TextPrompt]]) -> ScorePlan:
    """Each distinct text embedded once; a pair, the indices of its two texts."""
    places: dict[str | tuple[int, ...], int] = {}
    texts: list[ScorePrompt] = []

    def place(text: TextPrompt) -> int:
        key = text if isinstance(text, str) else tuple(text)
        if key not in places:
            places[key] = len(texts)
            texts.append(text)
        return places[key]

    return ScorePlan(texts, [(place(a), place(b)) for a, b in pairs])


def pair_prompt(first: TextPrompt, second: TextPrompt) -> ScorePrompt:
    """A cross-encoder's pair as one prompt: two texts as a text pair (the engine's tokenizer
    encodes it), two token-id lists joined."""
    if isinstance(first, str) and isinstance(second, str):
        return (first, second)
    if isinstance(first, list) and isinstance(second, list):
        return first + second
    raise ValueError("a cross-encoder pairs a text with a text, or token ids with token ids")


def check_cross_encoder(hf_config: dict[str, Any]) -> None:
    """A sequence classifier scores pairs with one label (a reranker's relevance logit), as
    vLLM's scores are: a ValueError for more."""
    num_labels = len(class_labels(hf_config))
    if num_labels != 1:
        raise ValueError(
            "score and rerank of a sequence-classification model (a cross-encoder) need one "
            f"label, its relevance logit; this model has {num_labels}: classify the pair with "
            "/classify (LLM.classify) instead"
        )


def check_pairing(num_first: int, num_second: int, names: tuple[str, str]) -> None:
    for name, count in zip(names, (num_first, num_second)):
        if count == 0:
            raise ValueError(f"{name} must not be empty")
    if num_first not in (1, num_second):
        raise ValueError(
            f"{names[0]} has {num_first} texts and {names[1]} {num_second}: score one text "
            f"against many (1 -> N) or lists of equal length pair by pair (N -> N)"
        )


def cosine_similarity(a: ArrayLike, b: ArrayLike) -> float:
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    norms = float(np.linalg.norm(a64) * np.linalg.norm(b64))
    return float(a64 @ b64) / max(norms, NORM_EPS)
