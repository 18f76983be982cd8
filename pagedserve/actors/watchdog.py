"""The supervisor's judgement: which actor is hung, and whether another restart is allowed.

Hung: an actor that has been ready sends a heartbeat every interval (heartbeat.py). No
heartbeat for `heartbeat_timeout_s` (the process is stopped, or wedged beyond its threads), or
a heartbeat saying the loop has not run for that long, makes it hung; a loop inside a declared
blocking call (a worker's step, which may be compiling kernels) has `blocking_timeout_s`.
Model loading happens before the actor is ready and is bounded by the ready timeout instead.

Restarts: a rate per actor (`restart_budget` within `restart_window_s`), plus a bound on starts
in a row that fail before the actor is ready (`max_failed_starts`): an actor that can no longer
start (the model does not load, the device is gone) is given up on after a few tries instead of
being restarted for a minute.
"""

from __future__ import annotations

import time
from collections import deque

from pagedserve.actors.supervision_messages import ActorStats
from pagedserve.config import SupervisionConfig


class HeartbeatMonitor:
    def __init__(self, config: SupervisionConfig) -> None:
        self.config = config
        self.last_seen: dict[str, float] = {}  # by label: monotonic time of its last heartbeat
        self.latest: dict[str, ActorStats] = {}

    def watch(self, label: str) -> None:
        """Start the clock for an actor that just became ready."""
        self.last_seen[label] = time.monotonic()
        self.latest.pop(label, None)

    def forget(self, label: str) -> None:
        self.last_seen.pop(label, None)

    def beat(self, stats: ActorStats) -> None:
        if stats.name in self.last_seen:
            self.last_seen[stats.name] = time.monotonic()
            self.latest[stats.name] = stats

    def hung(self) -> list[tuple[str, str]]:
        """(label, why) of every watched actor that is hung now."""
        now, found = time.monotonic(), []
        for label, seen in self.last_seen.items():
            silent = now - seen
            if silent > self.config.heartbeat_timeout_s:
                found.append((label, f"{label} sent no heartbeat for {silent:.1f} s"))
                continue
            stats = self.latest.get(label)
            if stats is None:
                continue
            bound = (
                self.config.blocking_timeout_s
                if stats.blocking
                else self.config.heartbeat_timeout_s
            )
            if stats.stalled_s > bound:
                inside = f" inside {stats.blocking}" if stats.blocking else ""
                found.append(
                    (label, f"{label}'s loop has not run for {stats.stalled_s:.1f} s{inside}")
                )
        return found


class RestartBudget:
    def __init__(self, config: SupervisionConfig) -> None:
        self.config = config
        self.times: dict[str, deque[float]] = {}  # by actor group: restarts in the window
        self.failed_starts: dict[str, int] = {}  # by actor group: failed starts in a row
        self.total: dict[str, int] = {}  # by actor group: restarts since the engine started

    def allow(self, group: str) -> bool:
        """Whether `group` may be restarted now (counts the restart if so)."""
        now = time.monotonic()
        times = self.times.setdefault(group, deque())
        while times and now - times[0] >= self.config.restart_window_s:
            times.popleft()
        if len(times) >= self.config.restart_budget:
            return False
        if self.failed_starts.get(group, 0) >= self.config.max_failed_starts:
            return False
        times.append(now)
        self.total[group] = self.total.get(group, 0) + 1
        return True

    def started(self, group: str, ok: bool) -> None:
        self.failed_starts[group] = 0 if ok else self.failed_starts.get(group, 0) + 1
