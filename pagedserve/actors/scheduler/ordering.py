"""The order of the scheduler's queues (EngineConfig.scheduling_policy).

fcfs: waiting requests in arrival order, a preempted one back at the front; running ones in
admission order. priority: both queues by (priority, arrival), lower first (vLLM's). Either
way the last running request is the one preempted first: the newest, or the lowest-priority.
"""

from __future__ import annotations

import bisect
from collections import deque
from operator import attrgetter

from pagedserve.actors.scheduler.request import Request
from pagedserve.config import EngineConfig

_priority_order = attrgetter("priority", "handle")  # handles grow with arrival


def to_waiting(
    waiting: deque[Request], req: Request, config: EngineConfig, preempted: bool
) -> None:
    if config.scheduling_policy == "priority":
        bisect.insort(waiting, req, key=_priority_order)
    elif preempted:
        waiting.appendleft(req)
    else:
        waiting.append(req)


def to_running(running: list[Request], req: Request, config: EngineConfig) -> None:
    if config.scheduling_policy == "priority":
        bisect.insort(running, req, key=_priority_order)
    else:
        running.append(req)
