#!/usr/bin/env python3
"""First-token latency and long prompts (issue 15's measurements), bf16, dummy weights.

- offline: batch-1 time to first token of a 128-token prompt (ZeroMQ client, from submit to
  the first delta), median of 20, on Qwen3-0.6B and Llama-3.1-8B shapes;
- served: the same through `pagedserve serve` (Qwen3-0.6B shapes, the real BPE tokenizer of
  make_tokenizer.py), one streamed completion at a time, median of 20;
- long prompts: 32 prompts of 7,000-8,000 tokens, 64 output tokens each, Llama-3.1-8B: the
  time of the whole batch.

    python scripts/gpu/bench_first_token.py --out FILE [--only offline-llama served ...]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))

from bench_serve_load import free_port, wait_healthy  # noqa: E402
from make_tokenizer import build  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.api import bench  # noqa: E402
from pagedserve.api.client import Client  # noqa: E402

CONFIGS = ROOT / "scripts" / "gpu" / "configs"
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def offline_ttft(model: str, repeats: int = 20, **engine: object) -> float:
    """Median ms from submitting a 128-token prompt to its first delta, batch 1; `engine`:
    more engine settings."""
    prompts = [p for p, _ in bench.random_workload(repeats + 2, (128, 128), (1, 1), 1000, 3)]
    with LLM(model, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
             **engine) as llm:  # fmt: skip
        with Client(llm.supervisor.addresses.engine_address) as client:
            times = []
            for prompt in prompts:
                start = time.perf_counter()
                next(iter(client.generate(prompt, ONE_TOKEN)))
                times.append((time.perf_counter() - start) * 1e3)
    free()
    return statistics.median(times[2:])  # the first two warm up


def served_ttft(repeats: int = 20) -> float:
    model_dir = build(CONFIGS / "qwen3-0.6b", Path(tempfile.mkdtemp()) / "qwen3")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.api.cli", "serve", str(model_dir), "--port",
         str(port), "--load-format", "dummy", "--max-model-len", "4096", "--served-model-name",
         "qwen3", "--generation-config", "vllm"]
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    prompts = [p for p, _ in bench.random_workload(repeats + 2, (128, 128), (1, 1), 1000, 4)]
    times = []
    try:
        wait_healthy(base, server, 300)
        with httpx.Client(timeout=60) as http:
            for prompt in prompts:
                body = {"model": "qwen3", "prompt": prompt, "max_tokens": 2, "stream": True}
                start = time.perf_counter()
                with http.stream("POST", base + "/v1/completions", json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            times.append((time.perf_counter() - start) * 1e3)
                            break
    finally:
        server.terminate()
        server.wait(60)
    return statistics.median(times[2:])


def long_prompts() -> float:
    workload = bench.random_workload(32, (7000, 8000), (64, 64), 1000, seed=5)
    args = dict(model=str(CONFIGS / "llama-3.1-8b"), load_format="dummy",
                skip_tokenizer_init=True, max_model_len=8192, device="cuda")  # fmt: skip
    result = bench.run_pagedserve(workload, args)
    free()
    return result.elapsed_s


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


MEASURES: dict[str, tuple[str, Callable[[], float]]] = {
    "offline-qwen3": ("offline TTFT, Qwen3-0.6B, 128 tokens (ms)",
                      lambda: offline_ttft(str(CONFIGS / "qwen3-0.6b"))),
    "offline-qwen3-8seqs": ("offline TTFT, Qwen3-0.6B, 128 tokens, max_num_seqs 8 (ms)",
                            lambda: offline_ttft(str(CONFIGS / "qwen3-0.6b"), max_num_seqs=8)),
    "offline-qwen3-8seqs-eager-prefill": (
        "offline TTFT, Qwen3-0.6B, 128 tokens, max_num_seqs 8, no prefill graphs (ms)",
        lambda: offline_ttft(str(CONFIGS / "qwen3-0.6b"), max_num_seqs=8, prefill_graph_sizes=()),
    ),
    "offline-llama": ("offline TTFT, Llama-3.1-8B, 128 tokens (ms)",
                      lambda: offline_ttft(str(CONFIGS / "llama-3.1-8b"))),
    "served": ("served TTFT, Qwen3-0.6B, real tokenizer (ms)", served_ttft),
    "long": ("32 x 7-8k prompts, 64 out, Llama-3.1-8B (s)", long_prompts),
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="+", choices=list(MEASURES), default=list(MEASURES))
    args = parser.parse_args()
    rows = {MEASURES[key][0]: MEASURES[key][1]() for key in args.only}
    lines = [f"## First token, {datetime.datetime.now():%Y-%m-%d %H:%M} (issue 15)", "",
             "| measure | pagedserve |", "|---|---:|"]  # fmt: skip
    lines += [f"| {name} | {value:.2f} |" for name, value in rows.items()]
    lines += ["", "```json", json.dumps(rows, indent=1), "```"]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
