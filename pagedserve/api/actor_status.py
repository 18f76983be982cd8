"""A view of each actor: the supervisor's status socket, as Prometheus metrics and as a table.

The supervisor keeps every actor's last heartbeat (busy and idle time, messages in and out,
rejected frames, queue depths, memory) and its restarts, and answers `StatusRequest` on its
status socket with an `EngineStatus`. Reading it needs the run's credentials, like any other
engine socket. `/metrics` (the API server) exports it; `pagedserve top` shows it live.
"""

from __future__ import annotations

import uuid

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagedserve.actors import bus
from pagedserve.actors.addresses import Addresses
from pagedserve.actors.security import Credentials, client_credentials
from pagedserve.actors.supervision_messages import EngineStatus, StatusRequest


class StatusClient:
    """Synchronous reader of the supervisor's status socket."""

    def __init__(self, address: str, credentials: Credentials | str | None = None) -> None:
        addresses = Addresses.from_engine_address(address)
        self._ctx = bus.sync_context(client_credentials(address, credentials))
        identity = f"status-{uuid.uuid4().hex[:12]}".encode()
        self._socket = bus.dealer_socket(self._ctx, addresses.status, identity)
        self._codec: bus.Codec[EngineStatus] = bus.Codec(EngineStatus, "status")

    def fetch(self, timeout_s: float = 5.0) -> EngineStatus:
        self._socket.send(bus.encode(StatusRequest()))
        if not self._socket.poll(int(timeout_s * 1000)):
            raise TimeoutError("the supervisor did not answer a status request")
        status = self._codec.decode(self._socket.recv())
        if status is None:
            raise TimeoutError("the supervisor's answer did not decode")
        return status

    def close(self) -> None:
        self._socket.close(linger=0)
        self._ctx.destroy(linger=0)


class AsyncStatusClient:
    """The same for an asyncio program (the API server); one request at a time."""

    def __init__(self, address: str, credentials: Credentials | None) -> None:
        addresses = Addresses.from_engine_address(address)
        self._ctx = bus.async_context(credentials)
        identity = f"status-{uuid.uuid4().hex[:12]}".encode()
        self._socket = bus.dealer_socket(self._ctx, addresses.status, identity)
        self._codec: bus.Codec[EngineStatus] = bus.Codec(EngineStatus, "status")

    async def fetch(self, timeout_s: float = 2.0) -> EngineStatus | None:
        while await self._socket.poll(0):  # a late answer to an earlier request
            await self._socket.recv()
        await self._socket.send(bus.encode(StatusRequest()))
        if not await self._socket.poll(int(timeout_s * 1000)):
            return None
        return self._codec.decode(await self._socket.recv())

    def close(self) -> None:
        self._socket.close(linger=0)
        self._ctx.destroy(linger=0)


class _ActorCollector:
    def __init__(self, status: EngineStatus) -> None:
        self.status = status

    def collect(self):  # -> Iterator[Metric]
        p = "pagedserve:actor_"
        up = GaugeMetricFamily(p + "up", "1 while the actor runs", labels=["actor"])
        restarts = CounterMetricFamily(p + "restarts", "Restarts", labels=["actor"])
        busy = CounterMetricFamily(p + "busy_seconds", "Loop thread CPU seconds", labels=["actor"])
        idle = CounterMetricFamily(p + "idle_seconds", "Uptime less busy time", labels=["actor"])
        msgs_in = CounterMetricFamily(p + "messages_in", "Frames received", labels=["actor"])
        msgs_out = CounterMetricFamily(p + "messages_out", "Frames sent", labels=["actor"])
        rejected = CounterMetricFamily(p + "rejected_frames", "Frames dropped", labels=["actor"])
        rss = GaugeMetricFamily(p + "rss_bytes", "Resident memory", labels=["actor"])
        queues = GaugeMetricFamily(p + "queue_depth", "Queue depths", labels=["actor", "queue"])
        gc_labels = ["actor", "generation"]  # "all", or "2": the full collections
        gc_count = CounterMetricFamily(p + "gc_collections", "Collections since start-up",
                                       labels=gc_labels)  # fmt: skip
        gc_pause = CounterMetricFamily(p + "gc_pause_seconds", "Collector pauses",
                                       labels=gc_labels)  # fmt: skip
        for actor in self.status.actors:
            label = [actor.label]
            up.add_metric(label, 1.0 if actor.state == "running" else 0.0)
            restarts.add_metric(label, actor.restarts)
            stats = actor.stats
            if stats is None:
                continue
            busy.add_metric(label, stats.busy_s)
            idle.add_metric(label, max(0.0, stats.uptime_s - stats.busy_s))
            msgs_in.add_metric(label, stats.messages_in)
            msgs_out.add_metric(label, stats.messages_out)
            rejected.add_metric(label, stats.rejected)
            rss.add_metric(label, stats.rss_bytes)
            for queue, depth in stats.queues.items():
                queues.add_metric([actor.label, queue], depth)
            gc = stats.gc
            gc_count.add_metric([actor.label, "all"], gc.collections)
            gc_count.add_metric([actor.label, "2"], gc.full_collections)
            gc_pause.add_metric([actor.label, "all"], gc.pause_s)
            gc_pause.add_metric([actor.label, "2"], gc.full_pause_s)
        yield from (up, restarts, busy, idle, msgs_in, msgs_out, rejected, rss, queues,
                    gc_count, gc_pause)  # fmt: skip


def render_prometheus(status: EngineStatus) -> bytes:
    registry = CollectorRegistry()
    registry.register(_ActorCollector(status))  # type: ignore[arg-type]
    return generate_latest(registry)


COLUMNS = "{:<14} {:>8} {:>8} {:>4} {:>8} {:>6} {:>9} {:>9} {:>5} {:>8} {:>7}  {}"
HEADER = COLUMNS.format(
    *("ACTOR", "PID", "STATE", "RST", "UPTIME", "BUSY%", "IN/s", "OUT/s", "REJ", "RSS MB"),
    *("GC ms", "QUEUES"),
)


def render_table(status: EngineStatus, previous: EngineStatus | None) -> str:
    """One line per actor; rates and busy % over the interval since `previous`."""
    before = {a.label: a.stats for a in previous.actors} if previous is not None else {}
    lines = [f"pagedserve  epoch {status.epoch}" + _dead(status), HEADER]
    for actor in status.actors:
        s, p = actor.stats, before.get(actor.label)
        if s is None:
            lines.append(COLUMNS.format(actor.label, "-", actor.state, actor.restarts,
                                        *["-"] * 7, ""))  # fmt: skip
            continue
        same = p is not None and p.pid == s.pid and s.uptime_s > p.uptime_s
        span = s.uptime_s - p.uptime_s if same and p is not None else s.uptime_s
        base = p if same else None
        busy = 100.0 * (s.busy_s - (base.busy_s if base else 0.0)) / max(span, 1e-9)
        rate_in = (s.messages_in - (base.messages_in if base else 0)) / max(span, 1e-9)
        rate_out = (s.messages_out - (base.messages_out if base else 0)) / max(span, 1e-9)
        gc_ms = 1e3 * (s.gc.pause_s - (base.gc.pause_s if base else 0.0))  # over the interval
        queues = " ".join(f"{k}={v}" for k, v in s.queues.items())
        lines.append(
            COLUMNS.format(
                actor.label, s.pid, actor.state, actor.restarts, f"{s.uptime_s:.0f}s",
                f"{min(busy, 100.0):.1f}", f"{rate_in:.1f}", f"{rate_out:.1f}", s.rejected,
                f"{s.rss_bytes / 2**20:.0f}", f"{gc_ms:.1f}", queues,
            )
        )  # fmt: skip
    return "\n".join(lines)


def _dead(status: EngineStatus) -> str:
    return f"  DEAD: {status.dead_reason}" if status.dead_reason else ""
