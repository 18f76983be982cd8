"""The issue's GPU workloads W1-W3 and start-up time, pagedserve and transformers in the same run
(bf16, dummy weights from the real configs in scripts/gpu/configs). One markdown table per
workload, written to --out.

    python scripts/gpu/bench_workloads.py --out FILE [--only W1 W3] [--hf-prompts 64]

W1 offline: Qwen3-0.6B, 256 requests, input and output lengths U[100, 1024].
W2 offline: Llama-3.1-8B, 1000 requests, input U[100, 300], output U[80, 280].
   (per request: input length, output length, then the prompt ids, from random.Random(0))
W3 latency: batch 1, 128-token prompt, 256 output tokens, time per output token.
W1/W2 run with max_num_seqs 1024 and max_num_batched_tokens 16384 (vLLM's offline defaults on
this GPU); W3 and start-up with pagedserve's defaults (256 / 8192).
Start-up: from LLM(...) to the first request accepted (Qwen3-0.6B dummy, CUDA graphs on).
profile: the device idle time between worker steps and the kernels of a step, from a
   torch.profiler window (W3, W1; --profile-runs W2 too).
transformers runs only the first --hf-prompts requests of W1/W2 (it needs minutes where
pagedserve needs seconds); its tok/s are over the tokens it was asked for.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pagedserve.api import bench  # noqa: E402
from pagedserve.config import read_hf_config  # noqa: E402

CONFIGS = ROOT / "scripts" / "gpu" / "configs"
QWEN = str(CONFIGS / "qwen3-0.6b")
LLAMA = str(CONFIGS / "llama-3.1-8b")
WORKLOADS = {
    "W1": (QWEN, 256, (100, 1024), (100, 1024)),
    "W2": (LLAMA, 1000, (100, 300), (80, 280)),
}


def engine_args(model: str, **extra) -> dict:
    return dict(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=4096,
        device="cuda",
        **extra,
    )


def free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def step_log_lines(directory: Path, label: str) -> list[str]:
    """The worker's step log (EngineConfig.profile with no window) and the actors' loop
    timers of one run, as markdown."""
    steps = json.loads((directory / "worker0.steps.json").read_text())
    worker = json.loads((directory / "worker0.loop.json").read_text())
    scheduler = json.loads((directory / "scheduler.loop.json").read_text())
    lines = [
        f"\n#### {label}: where the steps' time goes\n",
        "| steps | count | tokens | worker launch host s | Triton compiles s | device s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind, t in steps["by_kind"].items():
        lines.append(
            f"| {kind} | {t['steps']} | {t['tokens']} | {t['host_s']:.2f} | "
            f"{t['compile_s']:.2f} | {t['device_s']:.2f} |"
        )
    compiles = steps["compiles"]
    top = ", ".join(f"{k} {v['count']}x {v['s']:.2f} s" for k, v in compiles["kernels"].items())
    total = f"{compiles['count']} ({compiles['s']:.2f} s)"
    lines.append(f"\nTriton compiles during the run: {total}{': ' + top if top else ''}")
    for key in ("slowest_device", "slowest_host"):
        worst = "; ".join(
            f"#{r['step']} {r['kind']} {r['num_requests']} req {r['num_tokens']} tok "
            f"host {r['host_s'] * 1e3:.1f} ms device {r['device_s'] * 1e3:.1f} ms"
            for r in steps[key][:5]
        )
        lines.append(f"\n{key.replace('_', ' ')}: {worst}")
    phases = lambda d: ", ".join(  # noqa: E731
        f"{k} {v['s']:.2f} s ({v['count']})" for k, v in d.items() if isinstance(v, dict)
    )
    lines.append(f"\nworker loop (wall {worker['wall_s']:.2f} s): {phases(worker)}")
    lines.append(f"\nscheduler loop (wall {scheduler['wall_s']:.2f} s): {phases(scheduler)}")
    return lines


def workload_of(name: str) -> tuple[str, bench.Workload]:
    """W1's or W2's model and its requests (seed 0)."""
    model, num, input_len, output_len = WORKLOADS[name]
    vocab = int(read_hf_config(model)["vocab_size"])
    return model, bench.random_workload(num, input_len, output_len, vocab, seed=0)


def offline(name: str, hf_prompts: int, args: argparse.Namespace) -> list[str]:
    from pagedserve.config import ProfileConfig

    model, workload = workload_of(name)
    _, num, input_len, output_len = WORKLOADS[name]
    settings = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens)
    rows, details = [], []
    for attempt in range(args.repeat):
        extra = dict(settings)
        directory = Path(tempfile.gettempdir()) / "pagedserve-steps" / f"{name}-{attempt}"
        if args.step_log:
            extra["profile"] = ProfileConfig(output_dir=str(directory), num_steps=0)
        row = bench.run_pagedserve(workload, engine_args(model, **extra))
        row.backend = "pagedserve" + (f" (run {attempt + 1})" if args.repeat > 1 else "")
        if args.step_log:
            row.backend += ", step log on"
            details += step_log_lines(directory, row.backend)
        rows.append(row)
        print(json.dumps(row.row()), flush=True)
        free_gpu()
    if hf_prompts:
        subset = workload[:hf_prompts]
        hf = bench.load_hf_model(model, "dummy", "bfloat16", "cuda", "sdpa")
        rows.append(bench.run_hf_static(subset, hf, batch_size=hf_prompts))
        if args.hf_cb:
            try:
                cb = bench.load_hf_model(model, "dummy", "bfloat16", "cuda", "paged|sdpa")
                rows.append(bench.run_hf_continuous(subset, cb, max_batch_tokens=8192))
                del cb
            except Exception:
                traceback.print_exc()
        del hf
        free_gpu()
    lines = [
        f"### {name}: {Path(model).name}, {num} requests, input U{input_len}, "
        f"output U{output_len}\n",
        "| engine | requests | wall s | output tok/s | req/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.backend} | {r.num_requests} | {r.elapsed_s:.2f} | "
            f"{r.output_tok_s:,.0f} | {r.req_s:.2f} |"
        )
    ours = rows[0].output_tok_s
    for r in rows[args.repeat :]:
        lines.append(f"\npagedserve / {r.backend} = {ours / r.output_tok_s:.1f}x (output tok/s)")
    print(json.dumps([r.row() for r in rows]), flush=True)
    return lines + details


def latency(args: argparse.Namespace) -> list[str]:
    lines = [
        "### W3: batch 1, 128-token prompt, 256 output tokens\n",
        "| model | engine | time per output token ms |",
        "|---|---|---:|",
    ]
    for model in (QWEN, LLAMA):
        for run in range(args.repeat):  # each a new engine: 1 warm-up + 3 timed requests
            settings = engine_args(model, max_num_seqs=8, tensor_parallel_size=args.tp)
            ours = bench.latency_pagedserve(settings, 128, 256, iters=3)
            free_gpu()
            label = "pagedserve" + (f", TP {args.tp}" if args.tp > 1 else "")
            label += f" (engine {run + 1})" if args.repeat > 1 else ""
            lines.append(f"| {Path(model).name} | {label} | {ours['tpot_ms']:.2f} |")
            print(lines[-1], flush=True)
        if args.w3_cublas:  # the same without the Triton small-batch GEMM
            plain = engine_args(model, max_num_seqs=8, small_batch_gemm=False)
            cublas = bench.latency_pagedserve(plain, 128, 256, iters=3)
            free_gpu()
            lines.append(
                f"| {Path(model).name} | pagedserve, cuBLAS projections | {cublas['tpot_ms']:.2f} |"
            )
        if args.hf_latency:
            hf = bench.load_hf_model(model, "dummy", "bfloat16", "cuda", "sdpa")
            theirs = bench.latency_hf(hf, 128, 256, iters=1)
            lines.append(
                f"| {Path(model).name} | transformers generate | {theirs['tpot_ms']:.2f} |"
            )
            del hf
            free_gpu()
        print(lines[-1], flush=True)
    return lines


def profile(args: argparse.Namespace) -> list[str]:
    """Where the time goes: a torch.profiler window over 20 worker steps (device busy time and
    the idle gaps between kernels), and the worker's and scheduler's loop phases over the whole
    run (pagedserve.actors.worker.profiling). --profile-runs picks them: W3 (Qwen3-0.6B's
    batch-1 decode), W1 and W2 (the whole workload; the window in its decode steps)."""
    from pagedserve.config import ProfileConfig

    settings = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens)

    def offline_run(name: str) -> Callable[[ProfileConfig], Any]:
        def run(prof: ProfileConfig) -> Any:
            model, workload = workload_of(name)
            return bench.run_pagedserve(workload, engine_args(model, profile=prof, **settings))

        return run

    every_run = {  # (label, what runs, the window's first step)
        "W3": (
            "W3 Qwen3-0.6B batch 1",
            lambda prof: bench.latency_pagedserve(
                engine_args(QWEN, max_num_seqs=8, profile=prof), 128, 256, iters=1
            ),
            120,
        ),
        "W1": ("W1 (all 256 requests)", offline_run("W1"), 300),
        # W2's 15 or so mixed steps take the prompts; step 100 decodes ~800 requests
        "W2": ("W2 (all 1,000 requests)", offline_run("W2"), 100),
    }
    runs = {every_run[key][0]: every_run[key][1:] for key in args.profile_runs}
    idle = [
        "### Device idle time (torch.profiler window over 20 worker steps)\n",
        "| run | first step | wall µs/step | GPU busy µs/step | idle | gaps > 10 µs "
        "| median gap µs | largest gaps µs |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    loops = [
        "\n### Actor loops over the whole run (seconds)\n",
        "| run | result | worker: wall | waits for plan | launch | finish | waits for device "
        "| scheduler: waits | handles results | plans |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    kernels_table: list[str] = []
    for index, (name, (run, first_step)) in enumerate(runs.items()):
        directory = Path(tempfile.gettempdir()) / f"pagedserve-profile{index}"
        result = run(ProfileConfig(output_dir=str(directory), first_step=first_step, num_steps=20))
        free_gpu()
        s = json.loads((directory / "worker0.idle.json").read_text())
        idle.append(
            f"| {name} | {first_step} | {s['wall_per_step_us']:.0f} | "
            f"{s['busy_per_step_us']:.0f} | {s['idle_fraction']:.1%} | {s['num_gaps_over_10us']} "
            f"| {s['median_gap_us']:.1f} | {', '.join(f'{g:.0f}' for g in s['largest_gaps_us'])} |"
        )
        w = json.loads((directory / "worker0.loop.json").read_text())
        c = json.loads((directory / "scheduler.loop.json").read_text())

        def sec(d: dict, key: str) -> str:
            return f"{d.get(key, {}).get('s', 0.0):.2f}"

        summary = (
            f"{result['tpot_ms']:.2f} ms/token" if isinstance(result, dict)
            else f"{result.elapsed_s:.2f} s, {result.output_tok_s:,.0f} tok/s"
        )  # fmt: skip
        loops.append(
            f"| {name} | {summary} | {w['wall_s']:.2f} | {sec(w, 'wait_for_plan')} | "
            f"{sec(w, 'launch')} | {sec(w, 'finish')} | {sec(w, 'device_wait')} | "
            f"{sec(c, 'wait')} | {sec(c, 'handle')} | {sec(c, 'plan')} |"
        )
        kernels_table += [
            f"\n#### {name}: device time per step by kernel (profiler window)\n",
            "| kernel | launches / step | µs / step |",
            "|---|---:|---:|",
        ]
        for row in json.loads((directory / "worker0.kernels.json").read_text())[:18]:
            kernels_table.append(
                f"| {row['name'][:90]} | {row['per_step']:.1f} | {row['us_per_step']:.1f} |"
            )
        print(idle[-1], loops[-1], *kernels_table, sep="\n", flush=True)
    return idle + loops + kernels_table


def startup(args: argparse.Namespace) -> list[str]:
    """The first start on a fresh machine compiles every Triton kernel (cold JIT cache); a
    later start finds them in Triton's on-disk cache. With --startup-ab, more cold starts on
    the same machine, each with an empty Triton cache: with and without the parallel
    compile-only dry run (EngineConfig.compile_kernels_ahead)."""
    from pagedserve import LLM, SamplingParams

    fresh = [("first start on this machine (empty Triton cache)", True, "a")]
    if args.startup_ab:
        fresh += [
            ("empty Triton cache, kernels compiled one by one (compile_kernels_ahead off)",
             False, "b"),
            ("empty Triton cache, compile_kernels_ahead on", True, "c"),
        ]  # fmt: skip
    starts = fresh + [("later start (Triton cache of the start before)", True, fresh[-1][2])]
    lines = ["### Start-up: LLM(Qwen3-0.6B dummy, CUDA graphs on) until it accepts a request\n"]
    root = Path(tempfile.mkdtemp(prefix="triton-cache-"))
    for label, ahead, cache in starts:
        os.environ["TRITON_CACHE_DIR"] = str(root / cache)  # the actors inherit it
        start = time.perf_counter()
        with LLM(**engine_args(QWEN, compile_kernels_ahead=ahead)) as llm:
            ready = time.perf_counter() - start
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
            actors = llm.supervisor.startup_seconds
        free_gpu()
        phases = "; ".join(
            f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in t.items())
            for name, t in actors.items()
        )
        lines.append(f"- {label}: ready in {ready:.1f} s (seconds per actor: {phases})")
        print(lines[-1], flush=True)
    del os.environ["TRITON_CACHE_DIR"]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="+", default=["startup", "W1", "W2", "W3", "profile"])
    parser.add_argument("--hf-prompts", type=int, default=64)
    parser.add_argument("--hf-cb", action="store_true")
    parser.add_argument("--hf-latency", action="store_true")
    parser.add_argument("--startup-ab", action="store_true", help="more cold starts")
    parser.add_argument(
        "--profile-runs", nargs="+", choices=["W3", "W1", "W2"], default=["W3", "W1"],
        help="profile: the runs it profiles",
    )  # fmt: skip
    parser.add_argument("--tp", type=int, default=1, help="W3: tensor_parallel_size")
    parser.add_argument("--w3-cublas", action="store_true", help="W3 also with cuBLAS GEMMs")
    parser.add_argument(
        "--repeat", type=int, default=1, help="W1/W2/W3: pagedserve runs, each a new engine"
    )
    parser.add_argument(
        "--step-log", action="store_true", help="W1/W2: log every step (EngineConfig.profile)"
    )
    # W1/W2: vLLM's offline (LLM class) defaults on a GPU of this size, the peer's settings
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-batched-tokens", type=int, default=16384)
    args = parser.parse_args()
    sections = [
        f"# GPU workloads ({datetime.date.today()}, {torch.cuda.get_device_name()})\n",
        f"command: `python scripts/gpu/bench_workloads.py {' '.join(sys.argv[1:])}`\n",
    ]
    for name in args.only:
        try:
            if name == "startup":
                sections += startup(args)
            elif name == "profile":
                sections += profile(args)
            elif name == "W3":
                sections += latency(args)
            else:
                sections += offline(name, args.hf_prompts, args)
        except Exception:
            traceback.print_exc()
            sections.append(f"### {name}: FAILED (see log)")
        sections.append("")
        Path(args.out).write_text("\n".join(sections))
        print("\n".join(sections), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
