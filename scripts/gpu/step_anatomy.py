"""Anatomy of one decode step in the worker's ModelRunner, without the actors: the host's time
to launch a step (inputs, graph launch, sampling, the copy back), a step run to completion, the
time per step when steps are pipelined as the worker runs them (launch N + 1, then finish N),
whether the captured graph gives the eager run's logits, and a torch.profiler table of the
busiest ops. Dummy weights from a real config; KV
contexts are declared computed (their contents are zeros), which changes no timing.

    python scripts/gpu/step_anatomy.py [--model scripts/gpu/configs/qwen3-0.6b]
        [--batches 1 256] [--context 1024] [--device cuda] [--quantization fp8] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from pagedserve.actors.messages import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    StepPlan,
)
from pagedserve.actors.worker import startup  # noqa: E402
from pagedserve.actors.worker.model_runner import ModelRunner  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.kernels.attention_metadata import cdiv  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)


class DecodeSession:
    """`batch` requests with `context` computed tokens each, advanced one decode step at a
    time through runner.execute (the runner appends its own sampled tokens)."""

    def __init__(self, runner: ModelRunner, batch: int, context: int, first_block: int) -> None:
        self.runner, self.batch = runner, batch
        self.block_size = runner.block_size
        self.ids = [batch * 100_000 + i for i in range(batch)]  # handles
        self.num_computed = [context] * batch
        self.blocks_per_request = cdiv(min(context + 512, 4096), self.block_size)
        self.step_id = 0
        new = []
        for i, handle in enumerate(self.ids):
            start = first_block + i * self.blocks_per_request
            blocks = list(range(start, start + self.blocks_per_request))
            tokens = [(7 * i + t) % 1000 for t in range(context + 1)]
            new.append(NewRequestData(handle, tokens, len(tokens), GREEDY, i, blocks, context))
        self.pending_new: list[NewRequestData] = new

    @property
    def num_blocks(self) -> int:
        return self.batch * self.blocks_per_request

    def plan(self) -> StepPlan:
        cached = CachedRequestData()
        if not self.pending_new:
            cached = CachedRequestData(list(self.num_computed), [0] * self.batch)
        plan = StepPlan(
            step_id=self.step_id, new_requests=self.pending_new, cached_requests=cached,
            scheduled=list(self.ids), num_scheduled_tokens=[1] * self.batch,
        )  # fmt: skip
        self.pending_new = []
        self.step_id += 1
        self.num_computed = [n + 1 for n in self.num_computed]
        return plan

    def close(self) -> None:
        for handle in self.ids:
            self.runner.input_batch.remove_request(handle)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_parts(runner: ModelRunner, session: DecodeSession, iters: int) -> dict[str, float]:
    """Median ms of: the host's work to launch a step (nothing in flight, no sync after), a
    step run to completion, and (mean) a step when pipelined as the worker runs them."""
    device, parts = runner.device, {"launch": [], "execute": []}
    for _ in range(iters):
        plan = session.plan()
        sync(device)
        t0 = time.perf_counter()
        runner.launch(plan)
        t1 = time.perf_counter()
        runner.finish()
        sync(device)
        parts["launch"].append(t1 - t0)
    for _ in range(iters):
        plan = session.plan()
        sync(device)
        t0 = time.perf_counter()
        runner.execute(plan)
        sync(device)
        parts["execute"].append(time.perf_counter() - t0)
    medians = {k: statistics.median(v) * 1e3 for k, v in parts.items()}
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):  # the worker's way: launch N + 1, then finish N
        runner.launch(session.plan())
    runner.finish()
    sync(device)
    medians["pipelined"] = (time.perf_counter() - t0) / iters * 1e3
    return medians


def graph_vs_eager(runner: ModelRunner, session: DecodeSession) -> float | None:
    """Max |logits| difference between a decode step's graph replay and the same step's
    function run eagerly on the same static inputs (the KV write is idempotent)."""
    step = runner.decode_step
    if step is None or not step.graphs:
        return None
    runner.execute(session.plan())
    graph_logits = step.graphs[step.padded_size(session.batch)][1][: session.batch].clone()
    metadata = step.metadata(step.padded_size(session.batch), step.max_model_len)
    with torch.inference_mode():
        eager_logits = step.forward(step.padded_size(session.batch), metadata)[: session.batch]
    return (graph_logits.float() - eager_logits.float()).abs().max().item()


def profile_table(runner: ModelRunner, session: DecodeSession, steps: int, rows: int) -> str:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            runner.execute(session.plan())
        sync(runner.device)
    key = "self_cuda_time_total" if runner.device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(ROOT / "scripts/gpu/configs/qwen3-0.6b"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--quantization", default=None, help="e.g. fp8 (EngineConfig's)")
    parser.add_argument(
        "--gptq",
        action="store_true",
        help="int4 weights: Llama-3.1-8B's config with a GPTQ quantization_config "
        "(4 bits, groups of 128), dummy weights quantized while loading",
    )
    parser.add_argument(
        "--no-dependent-launch",
        action="store_true",
        help="EngineConfig.dependent_launch=False: kernel times in the profile "
        "then exclude the wait for the kernel before",
    )
    parser.add_argument("--profile-rows", type=int, default=18)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    model = args.model
    if args.gptq:
        from bench_quant import gptq_config_dir

        model = gptq_config_dir(Path(tempfile.mkdtemp()))
    blocks_needed = sum(b * cdiv(min(args.context + 512, 4096), 16) for b in args.batches)
    config = EngineConfig(
        model=model, load_format="dummy", device=args.device, dtype=args.dtype,
        max_model_len=4096, max_num_seqs=max(args.batches), num_kv_blocks=blocks_needed,
        attention_backend=args.backend, enforce_eager=args.eager, skip_tokenizer_init=True,
        quantization=args.quantization, dependent_launch=not args.no_dependent_launch,
    ).resolve()  # fmt: skip
    runner = ModelRunner(config)
    t0 = time.perf_counter()
    runner.load_model()
    t1 = time.perf_counter()
    startup.init_kv_cache(runner, blocks_needed)
    t2 = time.perf_counter()
    graphs = runner.decode_step.graphs if runner.decode_step else {}
    lines = [
        f"# Decode-step anatomy: {Path(args.model).name}, {args.dtype}, "
        f"{'int4 (GPTQ g128)' if args.gptq else args.quantization or 'unquantized'} weights, "
        f"{config.device}, dependent launch {config.dependent_launch}, "
        f"backend {runner.attention_backend} ({datetime.datetime.now():%Y-%m-%d %H:%M})\n",
        f"command: `python scripts/gpu/step_anatomy.py {' '.join(sys.argv[1:])}`\n",
        f"- load {t1 - t0:.1f} s; KV cache + graph capture {t2 - t1:.1f} s; "
        f"graphs captured: {len(graphs)}",
        "",
        "| batch | context | host launch ms | execute ms | pipelined ms/step "
        "| graph vs eager logits |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    first_block, tables = 0, []
    for batch in args.batches:
        session = DecodeSession(runner, batch, args.context, first_block)
        first_block += session.num_blocks
        runner.execute(session.plan())  # admit + warm up
        diff = graph_vs_eager(runner, session)
        parts = time_parts(runner, session, args.iters)
        check = "no graph" if diff is None else f"max diff {diff:.3g}"
        lines.append(
            f"| {batch} | {args.context} | {parts['launch']:.3f} | {parts['execute']:.3f} | "
            f"{parts['pipelined']:.3f} | {check} |"
        )
        print(lines[-1], flush=True)
        tables.append(f"\n### profile, batch {batch} ({5} steps)\n\n```\n"
                      f"{profile_table(runner, session, 5, args.profile_rows)}\n```")  # fmt: skip
        session.close()
    text = "\n".join(lines + tables) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
