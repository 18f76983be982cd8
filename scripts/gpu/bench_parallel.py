"""Tensor against pipeline parallelism on two GPUs (issue 14), one markdown report:

    python scripts/gpu/bench_parallel.py --out scripts/results/parallel_h200.md
        [--only parity latency throughput] [--layouts tp2 pp2]

parity: tiny random Llama and Qwen3 models (float32, TF32 off, CUDA graphs on) through the
   whole engine at TP 2, PP 2 and, given 4 GPUs, TP 2 x PP 2: greedy tokens against
   transformers', with chunked prefill (64-token budget) and preemption (14 KV blocks).
latency: W3-style, Llama-3.1-70B shapes (bf16, dummy weights): batch 1, 128-token prompt,
   256 output tokens, time per output token; beside it the weight-read floor of the layout
   (the weight bytes one GPU reads per token / the GPU's HBM bandwidth: a token passes the
   pipeline's stages one after the other, so PP 2 reads all of them in sequence).
throughput: 1,000 requests, input U[100, 300], output U[80, 280] (bench_workloads.py's W2
   shapes), Llama-3.1-70B shapes, per layout: wall time, output tok/s, req/s.
Every engine is a new one; the GPUs are free between them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))

import torch  # noqa: E402
from bench_workloads import CONFIGS, engine_args, free_gpu  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.api import bench  # noqa: E402
from pagedserve.config import read_hf_config  # noqa: E402
from tests.tiny_models import (  # noqa: E402
    hf_greedy,
    load_hf_model,
    random_prompts,
    save_tiny_model,
)

LLAMA_70B = str(CONFIGS / "llama-3.1-70b")
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}
HBM_BYTES_PER_S = 4.8e12  # H200
PARITY_TOKENS = 32


def layout_args(name: str) -> dict:
    tp, pp = LAYOUTS[name]
    return dict(tensor_parallel_size=tp, pipeline_parallel_size=pp)


def parity(layouts: list[str]) -> list[str]:
    torch.backends.cuda.matmul.allow_tf32 = False
    lines = [
        "### Parity: tiny models, float32, CUDA graphs on, chunked prefill and preemption\n",
        "| model | layout | greedy tokens identical to transformers | preemptions |",
        "|---|---|---:|---:|",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=PARITY_TOKENS, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("llama", "qwen3"):
            path = save_tiny_model(arch, Path(tmp) / arch, hidden_size=256)
            prompts = random_prompts(400, [1, 3, 7, 16, 17, 33, 50, 90], seed=1)
            reference = load_hf_model(path)
            expected = [hf_greedy(reference, p, PARITY_TOKENS)[0] for p in prompts]
            for name in layouts:
                if torch.cuda.device_count() < LAYOUTS[name][0] * LAYOUTS[name][1]:
                    continue
                try:
                    with LLM(
                        str(path), device="cuda", dtype="float32", num_kv_blocks=14,
                        enable_prefix_caching=False, max_num_batched_tokens=64,
                        **layout_args(name),
                    ) as llm:  # fmt: skip
                        outputs = llm.generate(prompts, params, use_tqdm=False)
                        preemptions = llm.get_stats().num_preemptions
                    got = [o.outputs[0].token_ids for o in outputs]
                    same = sum(g == e for g, e in zip(got, expected))
                    lines.append(f"| {arch} | {name} | {same}/{len(prompts)} | {preemptions} |")
                except Exception:
                    traceback.print_exc()
                    lines.append(f"| {arch} | {name} | ERROR (see log) | |")
                print(lines[-1], flush=True)
                free_gpu()
    return lines


def weight_read_floor_ms(layout: str) -> float:
    """Milliseconds to read, per token, the bf16 weights each GPU holds, stage after stage."""
    hf = read_hf_config(LLAMA_70B)
    hidden, inter, layers = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"]
    kv = hf["num_key_value_heads"] * hidden // hf["num_attention_heads"]
    per_layer = hidden * (2 * hidden + 2 * kv) + 3 * hidden * inter
    total = 2 * (layers * per_layer + 2 * hf["vocab_size"] * hidden)
    tp, pp = LAYOUTS[layout]
    return total / tp / HBM_BYTES_PER_S * 1e3  # the pp stages read theirs one after another


def latency(layouts: list[str]) -> list[str]:
    lines = [
        "### W3-style: Llama-3.1-70B shapes, batch 1, 128-token prompt, 256 output tokens\n",
        "| layout | time per output token ms | time to first token ms | weight-read floor ms |",
        "|---|---:|---:|---:|",
    ]
    for name in layouts:
        try:
            settings = engine_args(LLAMA_70B, max_num_seqs=8, **layout_args(name))
            result = bench.latency_pagedserve(settings, 128, 256, iters=3)
            lines.append(
                f"| {name} | {result['tpot_ms']:.2f} | {result['ttft_ms']:.1f} | "
                f"{weight_read_floor_ms(name):.1f} |"
            )
        except Exception:
            traceback.print_exc()
            lines.append(f"| {name} | ERROR (see log) | | |")
        print(lines[-1], flush=True)
        free_gpu()
    return lines


def throughput(layouts: list[str], args: argparse.Namespace) -> list[str]:
    vocab = int(read_hf_config(LLAMA_70B)["vocab_size"])
    workload = bench.random_workload(1000, (100, 300), (80, 280), vocab, seed=0)
    lines = [
        "### Throughput: Llama-3.1-70B shapes, 1,000 requests, input U[100, 300], "
        "output U[80, 280]\n",
        "| layout | wall s | output tok/s | req/s | start-up s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in layouts:
        try:
            settings = engine_args(
                LLAMA_70B, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_batched_tokens, **layout_args(name),
            )  # fmt: skip
            start = time.perf_counter()
            row = bench.run_pagedserve(workload, settings)
            total = time.perf_counter() - start
            lines.append(
                f"| {name} | {row.elapsed_s:.2f} | {row.output_tok_s:,.0f} | {row.req_s:.2f} "
                f"| {total - row.elapsed_s:.0f} |"
            )
            print(json.dumps(row.row()), flush=True)
        except Exception:
            traceback.print_exc()
            lines.append(f"| {name} | ERROR (see log) | | | |")
        print(lines[-1], flush=True)
        free_gpu()
    return lines


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="+", default=["parity", "latency", "throughput"])
    parser.add_argument("--layouts", nargs="+", default=["tp2", "pp2"], choices=list(LAYOUTS))
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-batched-tokens", type=int, default=8192)
    args = parser.parse_args()
    sections = [
        f"# Tensor and pipeline parallelism ({datetime.date.today()}, "
        f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()})\n",
        f"command: `python scripts/gpu/bench_parallel.py {' '.join(sys.argv[1:])}`\n",
    ]
    for part in args.only:
        if part == "parity":
            sections += parity(args.layouts + ["tp2pp2"])
        elif part == "latency":
            sections += latency(args.layouts)
        else:
            sections += throughput(args.layouts, args)
        sections.append("")
        Path(args.out).write_text("\n".join(sections))  # as it goes: a cut run keeps its parts
    print("\n".join(sections), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
