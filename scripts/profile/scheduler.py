"""Scheduler alone: steps per second with N running decode requests (no workers, no sockets).

Each step is what the scheduler actor does per step on the host: `schedule()` (the plan),
encoding the plan for the wire, and `update_from_result()` with one sampled token per request.
Requests never finish (ignore_eos, long max_tokens), so the running set stays at N.

    python scripts/profile/scheduler.py --running 256 1024 --steps 2000
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedserve.actors import bus
from pagedserve.actors.messages import AddRequest, SamplingParams, StepResult
from pagedserve.actors.scheduler.scheduler import Scheduler
from pagedserve.config import EngineConfig

PROMPT_LEN = 64


def build(running: int, max_model_len: int) -> Scheduler:
    config = EngineConfig(
        max_num_seqs=running, max_num_batched_tokens=max(8192, running * PROMPT_LEN),
        max_model_len=max_model_len, max_waiting_requests=running,
    )  # fmt: skip
    scheduler = Scheduler(config, num_kv_blocks=running * (max_model_len // 16 + 1))
    sampling = SamplingParams(temperature=0.0, max_tokens=max_model_len, ignore_eos=True)
    for i in range(running):
        prompt = [(i * 7 + j) % 1000 + 1 for j in range(PROMPT_LEN)]
        scheduler.add_request(
            AddRequest(client=b"c", seq=i, prompt_token_ids=prompt, sampling=sampling,
                       eos_token_ids=[0])
        )  # fmt: skip
    step(scheduler)  # the prefill step: every request is running after it
    return scheduler


def step(scheduler: Scheduler) -> tuple[float, float, float]:
    """One step: plan, encode, result. Seconds of each."""
    t0 = time.perf_counter()
    plan = scheduler.schedule()
    t1 = time.perf_counter()
    assert plan is not None
    bus.encode(plan)
    t2 = time.perf_counter()
    result = StepResult(
        step_id=plan.step_id, handles=plan.scheduled, sampled_token_ids=[7] * len(plan.scheduled)
    )
    scheduler.update_from_result(result)
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def measure(running: int, steps: int) -> dict[str, float]:
    scheduler = build(running, max_model_len=steps + PROMPT_LEN + 64)
    for _ in range(50):  # warm-up
        step(scheduler)
    samples = [step(scheduler) for _ in range(steps)]
    assert len(scheduler.running) == running
    totals = [sum(s) for s in samples]
    return {
        "running": running,
        "schedule_us": statistics.median(s[0] for s in samples) * 1e6,
        "encode_us": statistics.median(s[1] for s in samples) * 1e6,
        "update_us": statistics.median(s[2] for s in samples) * 1e6,
        "step_us_p50": statistics.median(totals) * 1e6,
        "step_us_p99": sorted(totals)[int(0.99 * len(totals))] * 1e6,
        "steps_per_s": len(totals) / sum(totals),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    print("| running | schedule µs | encode µs | update µs | step µs p50 | step µs p99 | steps/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for running in args.running:
        r = measure(running, args.steps)
        print(
            f"| {running} | {r['schedule_us']:.0f} | {r['encode_us']:.0f} | {r['update_us']:.0f}"
            f" | {r['step_us_p50']:.0f} | {r['step_us_p99']:.0f} | {r['steps_per_s']:.0f} |"
        )


if __name__ == "__main__":
    main()
