"""A torch.profiler window over a worker's steps and the device idle time it shows.

With `EngineConfig.profile` set, rank 0's worker profiles `num_steps` steps after skipping
`first_step` launches (warm-up, the prefill burst), writes the Chrome trace and a summary of
the device timeline: how much of the window the GPU was busy, and the gaps between kernels
(the host-side stalls between steps show up as the large ones). The worker and the
scheduler also write, when they close, how long their loops spent in each phase (LoopTimer):
waiting for input, working, sending, and the worker's wait for the device. The worker's
StepLog keeps every step of the run (shape, host time of its launch, device time, Triton
compiles met in it, counted by TritonCompileLog) and writes totals per kind of step and
the slowest steps.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass

import torch

from pagedserve.actors.loop_timer import LoopTimer
from pagedserve.config import ProfileConfig

__all__ = [
    "IdleSummary",
    "LoopTimer",
    "StepLog",
    "StepProfiler",
    "TritonCompileLog",
    "idle_summary",
]

logger = logging.getLogger(__name__)


@dataclass
class IdleSummary:
    num_steps: int
    window_us: float  # first kernel start to last kernel end
    busy_us: float  # union of kernel intervals
    idle_fraction: float
    num_gaps_over_10us: int
    median_gap_us: float
    largest_gaps_us: list[float]

    @property
    def wall_per_step_us(self) -> float:
        return self.window_us / max(self.num_steps, 1)

    @property
    def busy_per_step_us(self) -> float:
        return self.busy_us / max(self.num_steps, 1)

    def to_json(self) -> dict:
        return asdict(self) | {
            "wall_per_step_us": self.wall_per_step_us,
            "busy_per_step_us": self.busy_per_step_us,
        }


def idle_summary(intervals: list[tuple[float, float]], num_steps: int) -> IdleSummary:
    """Busy time and idle gaps of a device timeline given its kernels' (start, end) in µs
    (overlapping kernels, e.g. on several streams, count once)."""
    if not intervals:
        return IdleSummary(num_steps, 0.0, 0.0, 0.0, 0, 0.0, [])
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    busy = sum(end - start for start, end in merged)
    window = merged[-1][1] - merged[0][0]
    gaps = sorted(b[0] - a[1] for a, b in zip(merged, merged[1:]))
    return IdleSummary(
        num_steps=num_steps,
        window_us=window,
        busy_us=busy,
        idle_fraction=1.0 - busy / window if window > 0 else 0.0,
        num_gaps_over_10us=sum(g > 10.0 for g in gaps),
        median_gap_us=gaps[len(gaps) // 2] if gaps else 0.0,
        largest_gaps_us=[round(g, 1) for g in gaps[::-1][:8]],
    )


def kernel_table(spans: list[tuple[str, float]], num_steps: int) -> list[dict]:
    """Device time by kernel name (spans: name, duration µs), the largest first, per step."""
    count: Counter[str] = Counter()
    total: defaultdict[str, float] = defaultdict(float)
    for name, duration in spans:
        count[name] += 1
        total[name] += duration
    steps = max(num_steps, 1)
    return [
        {"name": name, "per_step": count[name] / steps, "us_per_step": total[name] / steps}
        for name in sorted(total, key=total.__getitem__, reverse=True)
    ]


class StepProfiler:
    """Call `on_launch()` before each step is launched; the window opens after
    `first_step` launches and closes `num_steps` launches later (num_steps 0: no window)."""

    def __init__(self, config: ProfileConfig, rank: int, device: torch.device) -> None:
        self.config, self.rank, self.device = config, rank, device
        self.launches = 0
        self.profiler: torch.profiler.profile | None = None

    def on_launch(self) -> None:
        if self.config.num_steps == 0:  # no window: the loop timers and the step log only
            return
        if self.launches == self.config.first_step:
            self._start()
        elif self.launches == self.config.first_step + self.config.num_steps:
            self.stop()
        self.launches += 1

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.start()

    def stop(self) -> None:
        """Close the window (if open) and write its trace and summary."""
        profiler, self.profiler = self.profiler, None
        if profiler is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        profiler.stop()
        os.makedirs(self.config.output_dir, exist_ok=True)
        prefix = os.path.join(self.config.output_dir, f"worker{self.rank}")
        profiler.export_chrome_trace(f"{prefix}.trace.json")
        events = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels = [(e.time_range.start, e.time_range.end) for e in events]
        steps = min(self.config.num_steps, self.launches - self.config.first_step)
        summary = idle_summary(kernels, steps)
        with open(f"{prefix}.idle.json", "w") as f:
            json.dump(summary.to_json(), f, indent=1)
        spans = [(e.name, e.time_range.end - e.time_range.start) for e in events]
        with open(f"{prefix}.kernels.json", "w") as f:
            json.dump(kernel_table(spans, steps), f, indent=1)
        logger.info("profiled %d steps: %s", steps, summary)


class TritonCompileLog:
    """Counts and times Triton JIT compilations (including loads from Triton's on-disk cache)
    in this process while installed: a kernel specialisation first met in the middle of a run
    stalls that step for as long as its compile takes."""

    def __init__(self) -> None:
        self.count: Counter[str] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self._original = None

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def reset(self) -> None:
        self.count.clear()
        self.seconds.clear()

    def install(self) -> None:
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            return
        original = JITFunction._do_compile
        log = self

        def timed_compile(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            start = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                name = getattr(self, "__name__", "kernel")
                log.count[name] += 1
                log.seconds[name] += time.perf_counter() - start

        JITFunction._do_compile = timed_compile
        self._original = original

    def uninstall(self) -> None:
        if self._original is not None:
            from triton.runtime.jit import JITFunction

            JITFunction._do_compile = self._original
            self._original = None

    def to_json(self) -> dict:
        kernels = {
            name: {"count": self.count[name], "s": round(self.seconds[name], 4)}
            for name in sorted(self.seconds, key=self.seconds.__getitem__, reverse=True)
        }
        return {"count": sum(self.count.values()), "s": round(self.total_seconds, 4)} | {
            "kernels": kernels
        }


@dataclass
class StepRecord:
    kind: str  # decode | mixed (some request has more than one token this step)
    num_requests: int
    num_tokens: int
    host_s: float  # the worker's launch of the step (includes finishing the one before)
    compile_s: float  # Triton compiles during that launch
    device_s: float = 0.0  # from this step's start on the stream to the next step's


class StepLog:
    """Every step of a run: its shape, the host time of its launch, the Triton compiles in
    it, and its time on the device (CUDA events recorded on the stream before each launch:
    a step's device time runs from its event to the next one, idle gaps included). Written
    as per-kind totals plus the slowest steps."""

    def __init__(self, device: torch.device, compiles: TritonCompileLog) -> None:
        self.device, self.compiles = device, compiles
        self.records: list[StepRecord] = []
        self.events: list[torch.cuda.Event] = []
        self._start = 0.0
        self._compile_start = 0.0

    def begin(self, num_scheduled_tokens: list[int]) -> None:
        kind = "mixed" if max(num_scheduled_tokens, default=1) > 1 else "decode"
        self.records.append(
            StepRecord(kind, len(num_scheduled_tokens), sum(num_scheduled_tokens), 0.0, 0.0)
        )
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
        self._compile_start = self.compiles.total_seconds
        self._start = time.perf_counter()

    def end(self) -> None:
        record = self.records[-1]
        record.host_s = time.perf_counter() - self._start
        record.compile_s = self.compiles.total_seconds - self._compile_start

    def _device_times(self) -> None:
        if not self.events:
            return
        last = torch.cuda.Event(enable_timing=True)
        last.record()
        last.synchronize()
        bounds = [*self.events, last]
        for record, start, end in zip(self.records, bounds, bounds[1:]):
            record.device_s = start.elapsed_time(end) / 1e3

    def summary(self) -> dict:
        self._device_times()
        by_kind: dict[str, dict[str, float]] = {}
        for r in self.records:
            totals = by_kind.setdefault(
                r.kind, {"steps": 0, "tokens": 0, "host_s": 0.0, "compile_s": 0.0, "device_s": 0.0}
            )
            totals["steps"] += 1
            totals["tokens"] += r.num_tokens
            totals["host_s"] += r.host_s
            totals["compile_s"] += r.compile_s
            totals["device_s"] += r.device_s
        for totals in by_kind.values():
            for key in ("host_s", "compile_s", "device_s"):
                totals[key] = round(totals[key], 4)

        def slowest(key: str) -> list[dict]:
            ranked = sorted(enumerate(self.records), key=lambda ir: -getattr(ir[1], key))
            return [{"step": i} | asdict(r) for i, r in ranked[:8]]

        sizes = Counter(f"{r.kind} {r.num_requests}" for r in self.records)
        return {
            "by_kind": by_kind,
            "steps_by_batch": dict(sorted(sizes.items(), key=lambda kv: -kv[1])),
            "slowest_host": slowest("host_s"),
            "slowest_device": slowest("device_s"),
            "compiles": self.compiles.to_json(),
        }

    def write(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.summary(), f, indent=1)
