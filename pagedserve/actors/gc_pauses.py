"""The Python garbage collector in an actor: its start-up heap frozen, its pauses counted.

A full (generation 2) collection walks every tracked object of the process. An actor's
start-up leaves most of them for good: the modules, a worker's model and CUDA graphs, Triton's
kernel caches (about 190,000 objects in a worker of the 94M `target` model; one full collection
of them took 70 ms on a 2-core CPU: tens of decode steps' worth, stalled at random). So, as
vLLM does, each actor collects once at the end of its start-up and freezes what is left
(`gc.freeze`: later collections skip those objects); what the actor allocates afterwards is
collected as usual. The collector's pauses after that (count, total and longest, of full
collections and of all) go out with the heartbeats (ActorStats) to `/metrics` and `pagedserve
top`, so a pause can be told from a slow step.
"""

from __future__ import annotations

import gc
import time

import msgspec

from pagedserve.actors.supervision_messages import GcStats


class GcPauses:
    """Counts the collector's pauses from install() on (gc.callbacks, on the thread that
    collects; the heartbeat thread reads a copy of the totals)."""

    def __init__(self) -> None:
        self.totals = GcStats()
        self._start = 0.0

    def install(self) -> None:
        gc.callbacks.append(self._on_collect)

    def freeze_start_up_heap(self) -> None:
        """Collect what start-up left as garbage, then move every surviving object to the
        permanent generation, out of later collections' walks."""
        gc.collect()
        gc.freeze()
        self.totals.frozen = gc.get_freeze_count()

    def stats(self) -> GcStats:
        return msgspec.structs.replace(self.totals)

    def _on_collect(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        pause = time.perf_counter() - self._start
        totals = self.totals
        totals.collections += 1
        totals.pause_s += pause
        totals.max_pause_s = max(totals.max_pause_s, pause)
        if info.get("generation") == 2:
            totals.full_collections += 1
            totals.full_pause_s += pause
