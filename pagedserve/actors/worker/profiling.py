"""A torch.profiler window over a worker's steps and the device idle time it shows.

With `EngineConfig.profile` set, rank 0's worker profiles `num_steps` steps after skipping
`first_step` launches (warm-up, the prefill burst), writes the Chrome trace and a summary of
the device timeline: how much of the window the GPU was busy, and the gaps between kernels
(the host-side stalls between steps show up as the large ones). The worker and the
scheduler also write, when they close, how long their loops spent in each phase (LoopTimer):
waiting for input, working, sending, and the worker's wait for the device.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from pagedserve.config import ProfileConfig

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


class StepProfiler:
    """Call `on_launch()` before each step is launched; the window opens after
    `first_step` launches and closes `num_steps` launches later."""

    def __init__(self, config: ProfileConfig, rank: int, device: torch.device) -> None:
        self.config, self.rank, self.device = config, rank, device
        self.launches = 0
        self.profiler: torch.profiler.profile | None = None

    def on_launch(self) -> None:
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
        kernels = [
            (e.time_range.start, e.time_range.end)
            for e in profiler.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
        ]
        steps = min(self.config.num_steps, self.launches - self.config.first_step)
        summary = idle_summary(kernels, steps)
        with open(f"{prefix}.idle.json", "w") as f:
            json.dump(summary.to_json(), f, indent=1)
        logger.info("profiled %d steps: %s", steps, summary)
