"""The n-gram proposer's prompt lookup: the k tokens that followed the latest earlier
occurrence of the request's longest suffix n-gram (prompt_lookup_max down to
prompt_lookup_min), or none."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.actors.worker.speculative import NgramProposer
from pagedserve.config import SpeculativeConfig


def proposer(k: int = 3, min_n: int = 2, max_n: int = 4) -> NgramProposer:
    spec = SpeculativeConfig(
        method="ngram", num_speculative_tokens=k, prompt_lookup_min=min_n, prompt_lookup_max=max_n
    )
    return NgramProposer(spec)


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Every n from the longest down, every earlier window, the latest match."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - 1 - n, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize(
    "tokens,expected",
    [
        ([1, 2, 3, 4, 9, 2, 3, 4], [9, 2, 3]),  # the 3-gram 2 3 4 recurs
        ([1, 2, 5, 6, 1, 2, 7, 8, 1, 2], [7, 8, 1]),  # the latest of two occurrences
        ([5, 6, 7, 5, 6, 9, 4, 5, 6, 7], [5, 6, 9]),  # the longer match wins over the later
        ([1, 2, 3, 4], []),  # no earlier occurrence
        ([1, 2, 1, 3], []),  # only a 1-gram recurs: below prompt_lookup_min
        ([4, 4], []),  # too short for a 2-gram before the suffix
        ([7, 1, 2, 1, 2], [1, 2]),  # overlapping: the match ends right before the suffix
    ],
)
def test_lookup_proposes_what_followed_the_longest_latest_suffix_match(
    tokens: list[int], expected: list[int]
) -> None:
    assert proposer().lookup(np.array(tokens)) == expected


def test_lookup_agrees_with_a_brute_force_search() -> None:
    rng = np.random.default_rng(0)
    for _ in range(500):
        k, min_n = int(rng.integers(1, 5)), int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 3))
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist()
        got = proposer(k, min_n, max_n).lookup(np.array(tokens))
        assert got == reference(tokens, k, min_n, max_n), (tokens, k, min_n, max_n)
