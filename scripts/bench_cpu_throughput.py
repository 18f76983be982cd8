"""CPU throughput: pagedserve vs transformers `generate` (static batching), same model, same
workload, same run. Writes a markdown table to scripts/results/cpu_throughput.md.

Workload (seeded): N requests, prompt length uniform in [P_MIN, P_MAX], output length uniform
in [O_MIN, O_MAX], random prompt ids, EOS ignored. "Useful" output tokens are the tokens each
request asked for; static batching also computes padding and the tokens of requests that are
already done, which is exactly what continuous batching saves.

    python scripts/bench_cpu_throughput.py [--requests 64] [--hf-batch 16 64]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import random
import sys
import time
from pathlib import Path

import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.config import DEFAULT_MODEL, resolve_model_path

RESULTS = Path(__file__).parent / "results" / "cpu_throughput.md"


def workload(n: int, vocab: int, seed: int, p: tuple[int, int], o: tuple[int, int]):
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        plen, olen = rng.randint(*p), rng.randint(*o)
        requests.append(([rng.randrange(10, vocab) for _ in range(plen)], olen))
    return requests


def run_pagedserve(model: str, requests, max_num_seqs: int) -> tuple[float, int]:
    with LLM(model, max_num_seqs=max_num_seqs, device="cpu") as llm:
        llm.generate([r[0] for r in requests[:4]], SamplingParams(max_tokens=4), use_tqdm=False)
        params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in requests]
        start = time.perf_counter()
        outputs = llm.generate([r[0] for r in requests], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    produced = sum(len(out.outputs[0].token_ids) for out in outputs)
    assert produced == sum(o for _, o in requests)
    return elapsed, produced


def run_hf_static(model_path: str, requests, batch_size: int) -> tuple[float, int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.eval()
    useful = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):  # left padding
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        max_new = max(o for _, o in batch)
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
        useful += sum(o for _, o in batch)
    return time.perf_counter() - start, useful


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--hf-batch", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args()
    path = resolve_model_path(args.model)
    vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
    requests = workload(
        args.requests, vocab, args.seed, tuple(args.prompt_len), tuple(args.output_len)
    )
    rows = []
    t, n = run_pagedserve(args.model, requests, max_num_seqs=args.requests)
    rows.append(("pagedserve (continuous batching, paged KV)", t, n))
    for bs in args.hf_batch:
        t_hf, n_hf = run_hf_static(path, requests, bs)
        rows.append((f"transformers generate, static batch {bs}", t_hf, n_hf))
    best_hf = max(r[2] / r[1] for r in rows[1:])
    ours = rows[0][2] / rows[0][1]
    lines = [
        "# CPU throughput: pagedserve vs transformers\n",
        f"- date: {datetime.date.today()}",
        f"- machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}, transformers {transformers.__version__}",
        f"- model: {args.model} ({path})",
        f"- workload: {args.requests} requests, prompt len U{tuple(args.prompt_len)}, "
        f"output len U{tuple(args.output_len)}, seed {args.seed}, greedy, EOS ignored",
        f"- command: `python scripts/bench_cpu_throughput.py {' '.join(sys.argv[1:])}`\n",
        "| engine | wall s | useful output tokens | output tok/s |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {t:.2f} | {n} | {n / t:.1f} |" for name, t, n in rows]
    lines.append(f"\npagedserve / best transformers = **{ours / best_hf:.2f}x**\n")
    text = "\n".join(lines)
    print(text)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
