"""Full-engine parity on the GPU: greedy tokens of tiny random Llama / Qwen2 / Qwen3 / Phi-3 models
through the whole multi-process engine on CUDA, with each attention backend (and CUDA graphs
on), against transformers. float32 on both sides (TF32 off) so that tokens must be identical.
Each engine generates twice: with logprobs (the sampler reads the decode step's logits) and
plain greedy (the decode step's own argmax, inside its CUDA graph, is the token).

    python scripts/gpu/parity.py [--backends triton cuda] [--archs llama qwen2 qwen3 phi3]
        [--jobs N] [--out FILE]

--jobs N checks up to N (arch, backend) rows at once, each in its own process.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from tests.tiny_models import (  # noqa: E402
    hf_greedy,
    load_hf_model,
    random_prompts,
    save_tiny_model,
)

LENGTHS = [1, 3, 7, 16, 17, 33, 50, 90]
NEW_TOKENS = 32


def check(
    arch: str, backend: str, eager: bool, workdir: Path, tp: int = 1
) -> tuple[int, int, float]:
    """(prompts matching in both runs, prompts, max |logprob diff|)."""
    path = save_tiny_model(arch, workdir / arch, hidden_size=256)  # head_dim 64
    prompts = random_prompts(400, LENGTHS, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    plain = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(
        str(path),
        device="cuda",
        dtype="float32",
        attention_backend=backend,
        enforce_eager=eager,
        tensor_parallel_size=tp,
        max_num_batched_tokens=64,
        num_kv_blocks=256,
    ) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        plain_outputs = llm.generate(prompts, plain, use_tqdm=False)
    matches, worst = 0, 0.0
    reference = load_hf_model(path)
    for prompt, output, plain_output in zip(prompts, outputs, plain_outputs):
        tokens, logprobs = hf_greedy(reference, prompt, NEW_TOKENS)
        completion = output.outputs[0]
        matches += completion.token_ids == tokens == plain_output.outputs[0].token_ids
        got = [next(iter(lp.values())).logprob for lp in completion.logprobs]
        n = min(len(got), len(logprobs))
        worst = max(worst, max(abs(a - b) for a, b in zip(got[:n], logprobs[:n])))
    return matches, len(prompts), worst


HEADER = [
    "| model | backend | CUDA graphs | greedy tokens identical | max abs logprob diff |",
    "|---|---|---|---:|---:|",
]


def run_in_parallel(args: argparse.Namespace) -> int:
    """Each (arch, backend) row in its own process, up to args.jobs at once."""
    rows = list(itertools.product(args.archs, args.backends))
    lines, ok = list(HEADER), True
    with tempfile.TemporaryDirectory() as tmp:
        for start in range(0, len(rows), args.jobs):
            batch = rows[start : start + args.jobs]
            ok &= run_rows(batch, args, Path(tmp), lines)
            print("\n".join(lines), flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0 if ok else 1


def run_rows(
    rows: list[tuple[str, str]], args: argparse.Namespace, tmp: Path, lines: list[str]
) -> bool:
    """One process per row at once; their table rows appended to `lines`."""
    # a few CPU threads each: transformers' CPU reference in several processes with a thread
    # per core each crawls (OpenMP threads spinning against each other)
    threads = max(1, (os.cpu_count() or 2) // len(rows))
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    outs = [tmp / f"{arch}-{backend}.md" for arch, backend in rows]
    extra = ["--tp", str(args.tp)] + (["--eager-too"] if args.eager_too else [])
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--archs", arch, "--backends", backend, "--out", str(out)]
            + extra,
            env=env,
        )
        for (arch, backend), out in zip(rows, outs)
    ]
    ok = True
    try:
        for proc, out in zip(procs, outs):
            ok &= proc.wait() == 0
            rows_text = out.read_text().splitlines()[2:] if out.exists() else []
            lines += rows_text or [f"| {out.stem} | | | ERROR (no output) | |"]
    finally:
        for proc in procs:  # none outlives this run (cut by a timeout, say)
            proc.kill()
    return ok


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", nargs="+", default=["triton", "cuda"])
    parser.add_argument("--archs", nargs="+", default=["llama", "qwen2", "qwen3"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (GPUs)")
    parser.add_argument("--eager-too", action="store_true", help="also run without CUDA graphs")
    args = parser.parse_args()
    if args.jobs > 1:
        return run_in_parallel(args)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    lines = list(HEADER)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs:
            for backend in args.backends:
                for eager in (False, True) if args.eager_too else (False,):
                    graphs = "off" if eager else "on"
                    try:
                        start = time.perf_counter()
                        workdir = Path(tmp) / f"{backend}{eager}"
                        m, n, worst = check(arch, backend, eager, workdir, args.tp)
                        label = backend if args.tp == 1 else f"{backend}, TP {args.tp}"
                        lines.append(f"| {arch} | {label} | {graphs} | {m}/{n} | {worst:.2e} |")
                        print(f"({arch} {backend}: {time.perf_counter() - start:.0f} s)")
                        ok &= m == n
                    except Exception:
                        traceback.print_exc()
                        lines.append(f"| {arch} | {backend} | {graphs} | ERROR | |")
                        ok = False
                    print(lines[-1], flush=True)
                    if args.out:  # as it goes: a run cut short keeps its rows
                        Path(args.out).write_text("\n".join(lines) + "\n")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
