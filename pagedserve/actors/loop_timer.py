"""LoopTimer: wall seconds an actor's loop spends in each phase. Its own module, free of
torch, so that the scheduler process does not import torch for it."""

from __future__ import annotations

import json
import os
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


class LoopTimer:
    """Wall seconds an actor's loop spends in each phase (waiting for input, working, sending),
    written next to the profile window's files when the actor closes."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.counts: Counter[str] = Counter()
        self.start = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start
            self.counts[name] += 1

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds
        self.counts[name] += 1

    def write(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        phases = {n: {"s": round(s, 4), "count": self.counts[n]} for n, s in self.seconds.items()}
        with open(path, "w") as f:
            json.dump({"wall_s": round(time.perf_counter() - self.start, 4)} | phases, f, indent=1)
