"""CPU throughput: pagedserve vs transformers `generate` (static batching), same model, same
workload, same run. Writes a markdown table to scripts/results/cpu_throughput.md.

Workload (seeded, `pagedserve.api.bench.random_workload`): N requests, prompt length uniform in
[P_MIN, P_MAX], output length uniform in [O_MIN, O_MAX], random prompt ids, EOS ignored.
"Useful" output tokens are the tokens each request asked for; static batching also computes
padding and the tokens of requests that are already done, which is exactly what continuous
batching saves.

    python scripts/bench_cpu_throughput.py [--requests 64] [--hf-batch 16 64]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import torch
import transformers

from pagedserve.api import bench
from pagedserve.config import DEFAULT_MODEL, read_hf_config, resolve_model_path

RESULTS = Path(__file__).parent / "results" / "cpu_throughput.md"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--hf-batch", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args()
    vocab = int(read_hf_config(resolve_model_path(args.model))["vocab_size"])
    workload = bench.random_workload(
        args.requests, tuple(args.prompt_len), tuple(args.output_len), vocab, args.seed
    )
    ours = bench.run_pagedserve(
        workload, {"model": args.model, "max_num_seqs": args.requests, "device": "cpu"}
    )
    hf_model = bench.load_hf_model(args.model, "auto", "float32", "cpu")
    peers = [bench.run_hf_static(workload, hf_model, size) for size in args.hf_batch]
    best = max(p.output_tok_s for p in peers)
    lines = [
        "# CPU throughput: pagedserve vs transformers\n",
        f"- date: {datetime.date.today()}",
        f"- machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}, transformers {transformers.__version__}",
        f"- model: {args.model}",
        f"- workload: {args.requests} requests, prompt len U{tuple(args.prompt_len)}, "
        f"output len U{tuple(args.output_len)}, seed {args.seed}, greedy, EOS ignored",
        f"- command: `python scripts/bench_cpu_throughput.py {' '.join(sys.argv[1:])}`\n",
        "| engine | wall s | useful output tokens | output tok/s |",
        "|---|---:|---:|---:|",
    ]
    for name, row in [("pagedserve (continuous batching, paged KV)", ours)] + [
        (f"transformers generate, static batch {size}", p) for size, p in zip(args.hf_batch, peers)
    ]:
        lines.append(f"| {name} | {row.elapsed_s:.2f} | {row.output_tokens} | "
                     f"{row.output_tok_s:.1f} |")  # fmt: skip
    lines.append(f"\npagedserve / best transformers = **{ours.output_tok_s / best:.2f}x**\n")
    text = "\n".join(lines)
    print(text)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
