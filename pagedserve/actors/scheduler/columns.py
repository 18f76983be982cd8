"""The counters of every unfinished request, one row each, in numpy columns.

They are the one owner of a request's `num_computed_tokens` and of how many of its sampled
tokens are in flight (`num_inflight`): `Request` reads and writes its row through properties,
and the scheduler's decode fast path (decode_path.py) reads and advances every running
request's row in a few array operations instead of a Python loop. A row also holds what the
fast path checks per step and never changes while the request lives (its handle; its prompt's
length; `limit`, the number of tokens at which it ends by length; whether it wants its prompt's
logprobs), and the columns count the stop tokens of the live requests (their union is the short
list of tokens that may end a request by content).
"""

from __future__ import annotations

import numpy as np

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


class RequestColumns:
    def __init__(self, capacity: int = 16) -> None:
        self.handle = np.full(capacity, -1, np.int64)  # -1: a free row
        self.num_computed = np.zeros(capacity, np.int64)
        self.num_inflight = np.zeros(capacity, np.int64)
        self.num_prompt = np.zeros(capacity, np.int64)
        self.limit = np.zeros(capacity, np.int64)
        self.wants_prompt_logprobs = np.zeros(capacity, bool)
        self._free = list(range(capacity - 1, -1, -1))  # pop() takes the lowest row
        self._stop_counts: dict[int, int] = {}  # stop token -> live requests that stop on it
        self._stop_tokens: np.ndarray | None = None  # their union, rebuilt when it changes

    def add(
        self,
        handle: int,
        num_prompt: int,
        limit: int,
        stop_tokens: frozenset[int],
        wants_prompt_logprobs: bool,
    ) -> int:
        """A row for a new request (zero counters); its index."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.handle[row] = handle
        self.num_computed[row] = 0
        self.num_inflight[row] = 0
        self.num_prompt[row] = num_prompt
        self.limit[row] = min(limit, INT64_MAX)
        self.wants_prompt_logprobs[row] = wants_prompt_logprobs
        for token in stop_tokens:
            if INT64_MIN <= token <= INT64_MAX:  # a sampled token is never outside int64
                count = self._stop_counts.get(token, 0)
                self._stop_counts[token] = count + 1
                if not count:
                    self._stop_tokens = None
        return row

    def release(self, row: int, stop_tokens: frozenset[int]) -> None:
        """The request finished: its row is free for another."""
        self.handle[row] = -1
        self._free.append(row)
        for token in stop_tokens:
            count = self._stop_counts.get(token)
            if count is None:
                continue
            if count == 1:
                del self._stop_counts[token]
                self._stop_tokens = None
            else:
                self._stop_counts[token] = count - 1

    @property
    def stop_tokens(self) -> np.ndarray:
        """Every token that stops some live request (EOS or a stop token id), sorted."""
        if self._stop_tokens is None:
            self._stop_tokens = np.array(sorted(self._stop_counts), np.int64)
        return self._stop_tokens

    def _grow(self) -> None:
        old = len(self.handle)
        self.handle = np.concatenate([self.handle, np.full(old, -1, np.int64)])
        names = ("num_computed", "num_inflight", "num_prompt", "limit", "wants_prompt_logprobs")
        for name in names:
            column = getattr(self, name)
            setattr(self, name, np.concatenate([column, np.zeros_like(column)]))
        self._free.extend(range(2 * old - 1, old - 1, -1))
