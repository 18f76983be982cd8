"""The worker's profiling window: idle-gap arithmetic and the files it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedserve.actors.worker.profiling import (
    StepLog,
    StepProfiler,
    TritonCompileLog,
    idle_summary,
    kernel_table,
)
from pagedserve.config import ProfileConfig
from tests.engine_settings import NO_STANDBY


def test_idle_summary_merges_overlaps_and_measures_gaps() -> None:
    kernels = [(0.0, 10.0), (5.0, 12.0), (30.0, 40.0), (41.0, 50.0), (150.0, 160.0)]
    summary = idle_summary(kernels, num_steps=2)
    assert summary.window_us == 160.0
    assert summary.busy_us == 12.0 + 10.0 + 9.0 + 10.0
    assert summary.idle_fraction == pytest.approx(1 - 41.0 / 160.0)
    assert summary.largest_gaps_us == [100.0, 18.0, 1.0]
    assert summary.num_gaps_over_10us == 2
    assert summary.median_gap_us == 18.0
    assert summary.wall_per_step_us == 80.0 and summary.busy_per_step_us == 20.5


def test_kernel_table_totals_device_time_per_kernel_and_step() -> None:
    spans = [("gemm", 10.0), ("norm", 2.0), ("gemm", 30.0), ("norm", 2.0), ("attn", 5.0)]
    table = kernel_table(spans, num_steps=2)
    assert [row["name"] for row in table] == ["gemm", "attn", "norm"]
    assert table[0] == {"name": "gemm", "per_step": 1.0, "us_per_step": 20.0}
    assert table[2] == {"name": "norm", "per_step": 1.0, "us_per_step": 2.0}


def test_idle_summary_of_nothing() -> None:
    summary = idle_summary([], num_steps=3)
    assert summary.window_us == 0.0 and summary.idle_fraction == 0.0


def test_step_profiler_window_writes_trace_and_summary(tmp_path: Path) -> None:
    config = ProfileConfig(output_dir=str(tmp_path / "prof"), first_step=2, num_steps=3)
    profiler = StepProfiler(config, rank=0, device=torch.device("cpu"))
    x = torch.randn(64, 64)
    for launch in range(7):
        profiler.on_launch()
        assert (profiler.profiler is not None) == (2 <= launch < 5)
        x = (x @ x).tanh()
    trace = json.loads((tmp_path / "prof" / "worker0.trace.json").read_text())
    assert any("mm" in event.get("name", "") for event in trace["traceEvents"])
    summary = json.loads((tmp_path / "prof" / "worker0.idle.json").read_text())
    assert summary["num_steps"] == 3 and summary["busy_us"] == 0.0  # no device on a CPU run
    profiler.stop()  # closing twice is harmless


def test_engine_profile_window_through_the_worker(tmp_path: Path) -> None:
    """EngineConfig.profile reaches rank 0's worker, which profiles that window of steps."""
    from pagedserve import LLM, SamplingParams

    out = tmp_path / "engine-prof"
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(
        profile=ProfileConfig(output_dir=str(out), first_step=4, num_steps=8),
        supervision=NO_STANDBY,
    ) as llm:
        (output,) = llm.generate("ROMEO:", params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 24
    summary = json.loads((out / "worker0.idle.json").read_text())
    assert summary["num_steps"] == 8
    assert (out / "worker0.trace.json").stat().st_size > 0
    worker = json.loads((out / "worker0.loop.json").read_text())
    assert worker["launch"]["count"] >= 24 and worker["wait_for_plan"]["count"] >= 24
    assert 0 < worker["launch"]["s"] < worker["wall_s"]
    steps = json.loads((out / "worker0.steps.json").read_text())
    kinds = steps["by_kind"]
    assert kinds["mixed"]["steps"] == 1 and kinds["decode"]["steps"] >= 23  # prompt, then 1/step
    assert kinds["decode"]["tokens"] == kinds["decode"]["steps"]
    assert steps["compiles"]["count"] == 0  # a CPU run compiles no Triton kernel
    startup = llm.supervisor.startup_seconds
    assert {"ready", "imports", "runner_init", "load_model", "kv_cache"} <= startup["worker"].keys()
    worker_s = startup["worker"]
    assert worker_s["ready"] >= worker_s["imports"] + worker_s["load_model"]
    assert worker_s["imports"] > 0 and worker_s["load_model"] > 0 and worker_s["runner_init"] > 0
    assert startup["scheduler"]["ready"] > 0 and startup["tokenizer"]["ready"] > 0
    scheduler = json.loads((out / "scheduler.loop.json").read_text())
    plans, handles = scheduler["plan"]["count"], scheduler["handle"]["count"]
    assert 0 < plans <= handles <= plans + 1  # each pass handles its messages, then plans
    assert scheduler["handle"]["s"] > 0


def test_engine_profile_timelines_join_into_each_requests_first_token_path(
    tmp_path: Path,
) -> None:
    """With profiling on, the scheduler, the worker and the detokenizer mark each request's
    first token on its way; the marks join by handle and step into one ordered path each."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.actors.timeline import FIRST_TOKEN_PATH, first_token_marks

    out = tmp_path / "timeline"
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    with LLM(
        profile=ProfileConfig(output_dir=str(out), num_steps=0), supervision=NO_STANDBY
    ) as llm:
        for prompt in ("ROMEO:", "JULIET: O", "Enter a"):
            llm.generate(prompt, params, use_tqdm=False)
    requests = first_token_marks(str(out))
    assert len(requests) == 3
    for times in requests:
        assert len(times) == len(FIRST_TOKEN_PATH)
        assert times == sorted(times), "each mark of the path follows the one before"
    assert requests[0][-1] <= requests[1][0] <= requests[1][-1] <= requests[2][0]


def test_step_log_totals_steps_by_kind_and_ranks_the_slowest() -> None:
    compiles = TritonCompileLog()
    log = StepLog(torch.device("cpu"), compiles)
    for tokens in ([100, 1], [1, 1, 1], [1, 1], [7]):
        log.begin(tokens)
        if tokens == [7]:
            compiles.seconds["fake_kernel"] += 0.25  # as if the launch compiled a kernel
            compiles.count["fake_kernel"] += 1
        log.end()
    summary = log.summary()
    assert summary["by_kind"]["mixed"]["steps"] == 2
    assert summary["by_kind"]["mixed"]["tokens"] == 108
    assert summary["by_kind"]["decode"] == pytest.approx(
        {"steps": 2, "tokens": 5, "host_s": summary["by_kind"]["decode"]["host_s"],
         "compile_s": 0.0, "device_s": 0.0}
    )  # fmt: skip
    assert summary["by_kind"]["mixed"]["compile_s"] == 0.25
    assert summary["compiles"]["count"] == 1
    assert summary["compiles"]["kernels"]["fake_kernel"] == {"count": 1, "s": 0.25}
    slowest = summary["slowest_host"]
    assert len(slowest) == 4 and slowest[0]["host_s"] >= slowest[-1]["host_s"]


def test_triton_compile_log_times_every_jit_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.runtime.jit import JITFunction

    calls = []

    def fake_compile(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(args)
        return "compiled"

    monkeypatch.setattr(JITFunction, "_do_compile", fake_compile)
    log = TritonCompileLog()
    log.install()

    class Kernel:
        __name__ = "my_kernel"

    try:
        assert JITFunction._do_compile(Kernel(), "key") == "compiled"
        assert JITFunction._do_compile(Kernel(), "key2") == "compiled"
    finally:
        log.uninstall()
    assert calls == [("key",), ("key2",)]
    assert log.count == {"my_kernel": 2} and log.total_seconds >= 0
    assert JITFunction._do_compile is fake_compile  # uninstalled
