"""Embeddings on the GPU: `LLM.embed` against transformers (tests/test_embeddings.py's oracle),
then what an embedding costs. One markdown report:

    python scripts/gpu/check_embeddings.py --out FILE [--only check timing]

check   a tiny Llama on the GPU in float32 (dtype "auto" would be bf16), LAST and MEAN
        pooling, prompts of 1-90 tokens with a token budget of 32 (the long ones in chunks),
        mixed with generate requests: the largest
        absolute difference of each embedding from transformers' (CPU, fp32) and the smallest
        cosine similarity.
timing  Qwen3-0.6B (dummy weights, bf16): 1,024 prompts of 128 tokens embedded, prompts per
        second and tokens per second; and a lone 128-token prompt's latency.
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_workloads import QWEN, engine_args, free_gpu  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.models.model_config import load_model_config  # noqa: E402
from tests.tiny_models import (  # noqa: E402
    hf_embedding,
    load_hf_model,
    random_prompts,
    save_tiny_model,
)


def check(root: Path) -> list[str]:
    base = save_tiny_model("llama", root / "tiny")
    model = load_hf_model(base)
    prompts = random_prompts(400, [1, 5, 16, 17, 40, 90], seed=3)
    lines = ["| pooling | prompts | max abs difference | min cosine |", "|---|---:|---:|---:|"]
    for pooling_type in ("LAST", "MEAN"):
        with LLM(
            str(base), device="cuda", dtype="float32", max_num_batched_tokens=32, max_num_seqs=8,
            pooler_config={"pooling_type": pooling_type, "normalize": True},
        ) as llm:  # fmt: skip
            llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)
            outputs = llm.embed(prompts, use_tqdm=False)
        worst, cosine = 0.0, 1.0
        for out, prompt in zip(outputs, prompts):
            got = torch.tensor(out.outputs.embedding)
            want = torch.tensor(hf_embedding(model, prompt, pooling_type))
            worst = max(worst, float((got - want).abs().max()))
            cosine = min(cosine, float(torch.nn.functional.cosine_similarity(got, want, dim=0)))
        lines.append(f"| {pooling_type} | {len(prompts)} | {worst:.1e} | {cosine:.6f} |")
        print(lines[-1], flush=True)
        free_gpu()
    return lines


def timing() -> list[str]:
    vocab = int(load_model_config(QWEN).vocab_size)
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(128)] for _ in range(1024)]
    with LLM(**engine_args(QWEN)) as llm:
        llm.embed(prompts[:64], use_tqdm=False)
        start = time.perf_counter()
        llm.embed(prompts, use_tqdm=False)
        seconds = time.perf_counter() - start
        lone = []
        for prompt in prompts[:20]:
            begin = time.perf_counter()
            llm.embed([prompt], use_tqdm=False)
            lone.append(time.perf_counter() - begin)
    free_gpu()
    lone.sort()
    return [
        "| workload | prompts / s | prompt tokens / s | lone prompt: median ms |",
        "|---|---:|---:|---:|",
        f"| Qwen3-0.6B, 1,024 x 128 tokens | {1024 / seconds:,.0f} | {1024 * 128 / seconds:,.0f} "
        f"| {lone[len(lone) // 2] * 1e3:.2f} |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="+", default=["check", "timing"])
    args = parser.parse_args()
    name = torch.cuda.get_device_name()
    report = [f"# Embeddings on {name}, {datetime.datetime.now():%Y-%m-%d %H:%M}"]
    with tempfile.TemporaryDirectory() as tmp:
        for title, run in (("check", lambda: check(Path(tmp))), ("timing", timing)):
            if title not in args.only:
                continue
            report.append(f"\n## {title}\n")
            try:
                report += run()
            except Exception:
                report.append("```\n" + traceback.format_exc() + "```")
            print("\n".join(report), flush=True)
    Path(args.out).write_text("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
