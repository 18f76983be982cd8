"""An actor's heartbeat: proof that its loop runs, and its counters, once per interval.

A thread of the actor sends `Heartbeat(ActorStats)` to the supervisor every
`heartbeat_interval_s`. The loop itself proves it runs by ticking `Liveness` from a task; the
heartbeat carries how long ago the loop last ticked (`stalled_s`), so the supervisor tells a
hung loop (stalled, no heartbeat at all when the whole process is stopped) from a busy one: a
loop that moves messages is running too, even if it never yields to the ticking task (an
asyncio socket with a frame ready does not suspend). A long call that blocks the loop on
purpose (a worker's step, which may compile kernels or export a profile) is declared with
`Liveness.blocking("step")`; the supervisor gives a declared call a longer bound.

Busy time is the CPU time of the loop's thread; idle time is the rest of the actor's uptime.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio
import zmq

from pagedserve.actors import bus
from pagedserve.actors.supervision_messages import ActorStats, GcStats, Heartbeat

TICK_S = 0.25  # the loop's tick; stalled_s is at least this coarse


class Liveness:
    """The loop's side: a tick from the loop, and its declared blocking calls."""

    def __init__(self) -> None:
        self.last_tick = time.monotonic()
        self.blocking_call = ""
        self._last_activity = -1

    def observe(self, activity: int) -> None:
        """From the heartbeat thread: frames moved since the last look are progress too."""
        if activity != self._last_activity:
            self._last_activity = activity
            self.last_tick = time.monotonic()

    async def tick_forever(self) -> None:
        while True:
            self.last_tick = time.monotonic()
            await anyio.sleep(TICK_S)

    @contextmanager
    def blocking(self, call: str) -> Iterator[None]:
        """A call that holds the loop on purpose (checked against the longer bound)."""
        self.blocking_call = call
        try:
            yield
        finally:
            self.blocking_call = ""
            self.last_tick = time.monotonic()

    def stalled_s(self) -> float:
        return max(0.0, time.monotonic() - self.last_tick)


class HeartbeatThread:
    """Sends the actor's stats to the supervisor every `interval_s` until stopped."""

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        interval_s: float,
        stats: Callable[[], ActorStats],
    ) -> None:
        self._socket = bus.push_socket(ctx, address)
        self._interval_s = interval_s
        self._stats = stats
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="heartbeat")

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._socket.send(bus.encode(Heartbeat(self._stats())), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the supervisor is away: it judges by silence anyway

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self._interval_s + 1)
        self._socket.close(linger=0)


class StatsProbe:
    """Measures what an actor reports: uptime, CPU time of the loop thread and of the
    process, resident memory."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self._loop_clock = time.pthread_getcpuclockid(threading.get_ident())
        self._page_size = os.sysconf("SC_PAGE_SIZE")

    def loop_cpu_s(self) -> float:
        return time.clock_gettime(self._loop_clock)

    def rss_bytes(self) -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self._page_size
        except OSError:
            return 0

    def stats(
        self,
        name: str,
        epoch: int,
        traffic: bus.Traffic,
        liveness: Liveness,
        queues: dict,
        gc_stats: GcStats,
    ) -> ActorStats:
        liveness.observe(traffic.messages_in + traffic.messages_out)
        return ActorStats(
            name=name, pid=os.getpid(), epoch=epoch,
            uptime_s=round(time.monotonic() - self.start, 3),
            busy_s=round(self.loop_cpu_s(), 3), cpu_s=round(time.process_time(), 3),
            rss_bytes=self.rss_bytes(), messages_in=traffic.messages_in,
            messages_out=traffic.messages_out, rejected=traffic.rejected, queues=queues,
            stalled_s=round(liveness.stalled_s(), 3), blocking=liveness.blocking_call,
            gc=gc_stats,
        )  # fmt: skip
