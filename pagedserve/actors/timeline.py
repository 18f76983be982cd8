"""Timeline: when each request and step passed through an actor, for the first-token anatomy.

With `EngineConfig.profile` set, the scheduler, rank 0's worker and the detokenizer mark events
(a request's arrival, the plan that first schedules it, the step's receipt, launch and samples
ready to report, the outputs' hand-over) with `time.perf_counter()`: CLOCK_MONOTONIC on Linux,
one clock for every process of the machine, so the marks of different actors subtract. Each
actor writes its marks to `<output_dir>/<actor>.timeline.json` when it closes;
`first_token_marks` joins them by handle and step id (scripts/gpu/first_token_anatomy.py prints
the hops). Torch-free (the scheduler imports it) and bounded (the oldest marks go first).
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Iterable

NO_REF = -1


class Timeline:
    def __init__(self, capacity: int = 200_000) -> None:
        # (event, key, ref, seconds): key a handle or a step id; ref the step id of a handle's
        # event where it names one (NO_REF otherwise)
        self.marks: deque[tuple[str, int, int, float]] = deque(maxlen=capacity)

    def mark(self, event: str, key: int, ref: int = NO_REF) -> None:
        self.marks.append((event, key, ref, time.perf_counter()))

    def mark_all(self, event: str, keys: Iterable[int], ref: int = NO_REF) -> None:
        now = time.perf_counter()
        self.marks.extend((event, key, ref, now) for key in keys)

    def write(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump([list(m) for m in self.marks], f)


def read_timeline(path: str) -> dict[str, dict[int, tuple[int, float]]]:
    """event -> key -> (ref, seconds) of the FIRST mark of each (event, key)."""
    first: dict[str, dict[int, tuple[int, float]]] = {}
    with open(path) as f:
        for event, key, ref, seconds in json.load(f):
            first.setdefault(event, {}).setdefault(key, (ref, seconds))
    return first


# A request's first token, mark by mark: (actor file, event, keyed by the step or the handle)
FIRST_TOKEN_PATH = (
    ("scheduler", "arrived", "handle"),
    ("scheduler", "plan_sent", "step"),
    ("worker0", "plan_in", "step"),
    ("worker0", "launched", "step"),
    ("worker0", "sampled", "step"),
    ("scheduler", "result_in", "step"),
    ("scheduler", "output_sent", "handle"),
    ("detokenizer", "detok_in", "handle"),
    ("detokenizer", "detok_out", "handle"),
)


def first_token_marks(directory: str) -> list[list[float]]:
    """Per request, in arrival order, the seconds of each mark of FIRST_TOKEN_PATH for the step
    that first scheduled it (a prompt that fits one step: the step of its first token).
    Requests missing a mark (cut off by the shutdown, the capacity) are left out."""
    marks = {
        actor: read_timeline(os.path.join(directory, f"{actor}.timeline.json"))
        for actor in ("scheduler", "worker0", "detokenizer")
    }
    arrived = marks["scheduler"].get("arrived", {})
    scheduled = marks["scheduler"].get("scheduled", {})
    requests = []
    for handle in sorted(arrived, key=lambda h: arrived[h][1]):
        if handle not in scheduled:
            continue
        step = scheduled[handle][0]
        times = []
        for actor, event, by in FIRST_TOKEN_PATH:
            mark = marks[actor].get(event, {}).get(handle if by == "handle" else step)
            if mark is None:
                break
            times.append(mark[1])
        if len(times) == len(FIRST_TOKEN_PATH):
            requests.append(times)
    return requests
