"""The supervisor's part of the wire schema: actors' heartbeats and the table of actors.

Channels (see bus.py for addresses):
  actor          -> supervisor : SupervisorInbound (ActorReady, ActorFailed, Heartbeat)
  a status client -> supervisor: StatusRequest, answered EngineStatus (`pagedserve top`, the
                                 API server's /metrics)
Same rules as messages.py: fields are added at the end, top-level messages are tagged.
"""

from __future__ import annotations

import msgspec

from pagedserve.actors.messages import ActorFailed, ActorReady


class GcStats(msgspec.Struct, kw_only=True):
    """The actor's garbage collector since its start-up (actors/gc_pauses.py)."""

    frozen: int = 0  # objects frozen at the end of start-up: no collection walks them
    collections: int = 0  # collections of any generation since
    full_collections: int = 0  # of generation 2
    pause_s: float = 0.0  # seconds the collections took, all of them
    full_pause_s: float = 0.0  # of the full ones
    max_pause_s: float = 0.0  # the longest one


class ActorStats(msgspec.Struct, kw_only=True):
    """What an actor reports of itself with every heartbeat."""

    name: str
    pid: int
    epoch: int  # the epoch it was started at
    uptime_s: float
    busy_s: float  # CPU seconds of the actor's loop thread (idle: uptime_s - busy_s)
    cpu_s: float  # CPU seconds of the whole process (encode threads, torch threads...)
    rss_bytes: int
    messages_in: int
    messages_out: int
    rejected: int  # frames dropped: malformed, or of another channel
    queues: dict[str, int] = {}  # the actor's own queue depths (waiting requests, streams...)
    stalled_s: float = 0.0  # seconds since the actor's loop last ran
    blocking: str = ""  # a declared long blocking call in progress (the worker's step)
    gc: GcStats = msgspec.field(default_factory=GcStats)


class Heartbeat(msgspec.Struct, tag=True):
    """Actor -> supervisor, every heartbeat interval, from a thread of the actor: its loop is
    alive (or how long it has not run) and its counters."""

    stats: ActorStats


class StatusRequest(msgspec.Struct, tag=True):
    """Anyone with the run's credentials -> supervisor: the table of actors (EngineStatus)."""


class ActorStatus(msgspec.Struct, kw_only=True):
    label: str
    state: str  # running | starting | dead
    restarts: int  # restarts of this actor since the engine started
    stats: ActorStats | None = None  # its last heartbeat (None before the first)


class EngineStatus(msgspec.Struct, tag=True, kw_only=True):
    epoch: int
    dead_reason: str | None = None
    actors: list[ActorStatus] = []


SupervisorInbound = ActorReady | ActorFailed | Heartbeat
