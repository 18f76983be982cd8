"""Scores of text pairs for an embedding model (vLLM's score and rerank APIs, bi-encoder): a
pair's score is the cosine similarity of its two texts' embeddings. One text against many
(1 -> N) or two lists pair by pair (N -> N); each distinct text is embedded once. Shared by
`LLM.score` and the server's /score and /rerank."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from pagedserve.models.model_config import is_sequence_classifier

TextPrompt = str | list[int]  # a text, or its token ids
NORM_EPS = 1e-8  # as torch's cosine_similarity (vLLM's): a zero vector scores 0


@dataclass(frozen=True)
class ScorePlan:
    """The distinct texts to embed, and each pair (in the second list's order) as indices
    into them."""

    texts: list[TextPrompt]
    pairs: list[tuple[int, int]]


def plan_scores(
    first: Sequence[TextPrompt], second: Sequence[TextPrompt], names: tuple[str, str]
) -> ScorePlan:
    """The pairs of `first` (one text, or as many as `second`) and `second`; a ValueError
    names the lists (`names`) when they do not pair."""
    check_pairing(len(first), len(second), names)
    if len(first) == 1:
        first = [first[0]] * len(second)
    places: dict[str | tuple[int, ...], int] = {}
    texts: list[TextPrompt] = []

    def place(text: TextPrompt) -> int:
        key = text if isinstance(text, str) else tuple(text)
        if key not in places:
            places[key] = len(texts)
            texts.append(text)
        return places[key]

    return ScorePlan(texts, [(place(a), place(b)) for a, b in zip(first, second)])


def check_bi_encoder(hf_config: dict) -> None:
    """A ValueError for a sequence-classification model: its scores would be a cross-encoder's
    (the pair as one sequence through its head), which pagedserve does not compute."""
    if is_sequence_classifier(hf_config):
        raise ValueError(
            "score and rerank of a sequence-classification model (a cross-encoder) are not "
            "supported: pagedserve scores pairs by the cosine similarity of an embedding "
            "model's vectors; classify texts with /classify (LLM.classify)"
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


def pair_scores(vectors: Sequence[ArrayLike], pairs: list[tuple[int, int]]) -> list[float]:
    """Each pair's score, from the embeddings of the plan's texts."""
    return [cosine_similarity(vectors[a], vectors[b]) for a, b in pairs]
