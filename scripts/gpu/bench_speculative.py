#!/usr/bin/env python3
"""Speculative decoding on the H200 (issue 12): train the ~94M target, then time it.

1. Trains `scripts/train_tiny_model.py train --preset target` on the Shakespeare data of
   `prepare` (carried in --data), time-limited (--train-seconds, 120 s by default; the issue
   allows < 3 min), into a model directory with the embedded model's tokenizer; the embedded
   4M model is its draft.
2. The issue's workloads, each on its engine (one engine per config, every prompt set of it):
   - batch 1, greedy, 256 output tokens per Shakespeare prompt, without speculation and with
     the draft model (--draft-k): time per output token, streamed through the ZeroMQ client
     ((last - first) / (tokens - 1), median over the prompts), and the acceptance rate;
   - the same on copy-heavy prompts (a passage, then its first line again), without
     speculation and with n-gram (--ngram-k): `copy` is one passage (Julius Caesar) 5 times,
     `copy-held-out` 5 passages of the data's validation split, text the target never
     trained on (so what it copies is in its context, not in its weights);
   - batch 64 x 256 tokens with each: output tokens/s (median of 7 runs after a warm-up run),
     speculation switched off above batch 16 (disable_by_batch_size, --disable-above).
   The plain, draft and n-gram engines run in turn --passes times, and a plain engine once
   more last; each row is the mean of its engines, ratios against the plain rows. Speculative
   configs verify --rounds rounds per step (num_rounds). --full adds one-round, always-on and
   other k rows.
3. Prints the final table and writes it, with the raw rows, to --out. About 5 minutes of GPU
   time with the default training time.

    python scripts/gpu/bench_speculative.py --data .gpu_data/data --out FILE
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.api.bench import spec_decode_summary  # noqa: E402
from pagedserve.api.client import Client  # noqa: E402

DRAFT = "pagedserve/tiny-shakespeare"
PROMPTS = [
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "KING HENRY V:\nOnce more unto the breach, dear friends, once more;",
    "HAMLET:\nTo be, or not to be, that is the question:",
    "MACBETH:\nTomorrow, and tomorrow, and tomorrow,",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
]
PASSAGE = (
    "Friends, Romans, countrymen, lend me your ears;\nI come to bury Caesar, not to praise him.\n"
    "The evil that men do lives after them;\nThe good is oft interred with their bones;\n"
    "So let it be with Caesar. The noble Brutus\nHath told you Caesar was ambitious:\n"
    "If it were so, it was a grievous fault,\nAnd grievously hath Caesar answer'd it.\n"
    "Here, under leave of Brutus and the rest--\nFor Brutus is an honourable man;\n"
    "So are they all, all honourable men--\nCome I to speak in Caesar's funeral.\n"
    "He was my friend, faithful and just to me:\nBut Brutus says he was ambitious;\n"
    "And Brutus is an honourable man.\nHe hath brought many captives home to Rome\n"
    "Whose ransoms did the general coffers fill:\nDid this in Caesar seem ambitious?\n"
    "When that the poor have cried, Caesar hath wept:\nAmbition should be made of sterner "
    "stuff:\nYet Brutus says he was ambitious;\nAnd Brutus is an honourable man.\n"
)  # long enough that copying it again covers the 256 output tokens


def copy_prompt(passage: str) -> str:
    """A passage, then its first line again and the start of its second: the target continues
    by copying."""
    lines = passage.split("\n")
    return passage + "\n" + lines[0] + "\n" + lines[1][:12]


# the one copy prompt 5 times: batch 1's median then rides over one stalled run
COPY_PROMPTS = [copy_prompt(PASSAGE)] * 5


def held_out_passages(data: str, count: int, tokens: int = 400) -> list[str]:
    """`count` passages of the validation split (`prepare`'s val.npy, decoded with its
    tokenizer), evenly spaced, each ~`tokens` tokens cut to whole lines of text."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(data) / "tokenizer" / "tokenizer.json"))
    ids = np.load(Path(data) / "val.npy")
    passages = []
    for i in range(count):
        start = (i * (len(ids) - 2 * tokens)) // count
        text = tokenizer.decode(ids[start : start + 2 * tokens].tolist())
        lines = [line for line in text.split("\n")[1:-1] if line.strip()]
        passage, length = [], 0
        for line in lines:  # whole lines up to ~`tokens` tokens
            passage.append(line)
            length += len(tokenizer.encode(line).ids) + 1
            if length >= tokens:
                break
        passages.append("\n".join(passage) + "\n")
    return passages


def train_target(data: str, out: Path, time_limit: int, copy_frac: float,
                 steps: int | None) -> dict:  # fmt: skip
    """Train `steps` steps (by default those the H200 runs in `time_limit`: ~9 a second with
    the evals, session 6 ran 600 in 67 s), so that the cosine schedule ends and a seed gives
    one model; the time limit stops a slower machine (an H100 host runs 5.8-6.2 steps a
    second: give it steps it finishes, for the same model on every host)."""
    steps = steps or max(100, 8 * time_limit)
    command = [sys.executable, str(ROOT / "scripts" / "train_tiny_model.py"), "train",
               "--preset", "target", "--data", data, "--out", str(out), "--device", "cuda",
               "--steps", str(steps), "--batch", "32", "--seq-len", "512", "--lr", "1e-3",
               "--eval-every", "100", "--time-limit", str(time_limit),
               "--copy-frac", str(copy_frac), "--deterministic"]  # fmt: skip
    start = time.time()
    subprocess.run(command, check=True)
    metrics = json.loads((out / "metrics.json").read_text())
    metrics["train_wall_s"] = round(time.time() - start, 1)
    return {k: v for k, v in metrics.items() if k != "history"}


def time_per_token(llm: LLM, prompts: list[str], max_tokens: int) -> float:
    """Median over prompts of (last - first token arrival) / (tokens - 1), batch 1."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    per_token = []
    with Client(llm.supervisor.addresses.engine_address) as client:
        for prompt in prompts:
            stamps, count = [], 0
            for delta in client.generate(prompt, params):
                stamps.append(time.perf_counter())
                count += len(delta.token_ids)
            per_token.append((stamps[-1] - stamps[0]) / (count - 1))
    return median(per_token)


def throughput(llm: LLM, prompts: list[str], batch: int, max_tokens: int) -> float:
    """Output tokens/s of `batch` requests at once: the median of 7 runs after a warm-up run
    (its first steps of this batch may compile kernels). A run lasts ~0.25 s: this process's
    start-up heap is frozen first (as the actors' are), so that a full collection of it does
    not land in one run and not in another."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
    gc.collect()
    gc.freeze()
    rates = []
    for _ in range(8):
        start = time.perf_counter()
        outputs = llm.generate(batch_prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
    return median(rates[1:])


def run_config(target: str, name: str, spec: dict | None, prompt_sets: dict[str, list[str]],
               engine: dict) -> list[dict]:  # fmt: skip
    """One engine (`engine`: its further LLM arguments): a row per prompt set (batch 1, then
    batch 64)."""
    extra = engine if spec is None else engine | {"speculative_config": spec}
    rows = []
    with LLM(target, max_model_len=1024, **extra) as llm:
        for prompts_name, prompts in prompt_sets.items():
            time_per_token(llm, prompts[:1], 32)  # warm-up: kernels, graphs
            before = llm.get_stats()
            ms = time_per_token(llm, prompts, 256) * 1e3
            after = llm.get_stats()
            tok_s = throughput(llm, prompts, 64, 256)
            row = {"config": name, "prompts": prompts_name, "batch1_ms_per_token": round(ms, 3),
                   "batch64_tok_s": round(tok_s)}  # fmt: skip
            if spec is not None:
                row |= spec_decode_summary(before, after)
            print(json.dumps(row), flush=True)
            rows.append(row)
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def mean_rows(runs: list[dict]) -> list[dict]:
    """One row per (config, prompts): the mean of its engines' numbers, in first-run order."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        name = run["config"].removesuffix(" (again, last)")
        groups.setdefault((name, run["prompts"]), []).append(run)
    rows = []
    for (name, prompts), group in groups.items():
        row: dict = {"config": name, "prompts": prompts, "engines": len(group)}
        for key, value in group[0].items():
            if isinstance(value, (int, float)):
                mean = sum(g[key] for g in group) / len(group)
                row[key] = round(mean, 4 if isinstance(value, float) else 0)
        rows.append(row)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """Each row against no speculation on its prompts (the mean of the plain engines, the first
    and the last): batch-1 speed-up (plain ms per token / its ms per token) and batch-64
    throughput ratio."""
    plain: dict[str, list[dict]] = {}
    for row in rows:
        if row["config"].startswith("no speculation"):
            plain.setdefault(row["prompts"], []).append(row)
    for row in rows:
        bases = plain.get(row["prompts"])
        if bases:
            ms = sum(b["batch1_ms_per_token"] for b in bases) / len(bases)
            tok_s = sum(b["batch64_tok_s"] for b in bases) / len(bases)
            row["batch1_speedup"] = round(ms / row["batch1_ms_per_token"], 2)
            row["batch64_vs_plain"] = round(row["batch64_tok_s"] / tok_s, 2)


Config = tuple[str, dict | None, dict[str, list[str]], dict]


def configs(args: argparse.Namespace) -> list[Config]:
    """(name, speculative_config, prompt sets, further LLM arguments) of each engine: the
    issue's rows, --full more; with --gemm-rows, the speculative rows again with the Triton
    GEMM up to that many rows (small_batch_gemm_rows)."""
    shakespeare = {"shakespeare": PROMPTS}
    copy = {"copy": COPY_PROMPTS}
    if not args.smoke:
        held_out = held_out_passages(args.data, 5)
        copy |= {"copy-held-out": [copy_prompt(p) for p in held_out]}
    draft = lambda k: {"model": DRAFT, "num_speculative_tokens": k}  # noqa: E731
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
             "prompt_lookup_min": 2}  # fmt: skip
    # speculation off above batch args.disable_above: a batch-64 step is no longer
    # launch-bound, so verifying 1 + k rows per request costs more than it saves
    off = {"disable_by_batch_size": args.disable_above}
    rounds = {"num_rounds": args.rounds}  # verifies per scheduler round trip
    above, r = f"off above batch {args.disable_above}", f"{args.rounds} rounds"
    rows: list[Config] = [("no speculation", None, shakespeare | copy, {})]
    if "draft" in args.methods:
        spec = draft(args.draft_k) | rounds | off
        rows.append((f"draft k={args.draft_k}, {r}, {above}", spec, shakespeare, {}))
    if "ngram" in args.methods:
        for k in args.ngram_k:
            spec = ngram | {"num_speculative_tokens": k} | rounds | off
            rows.append((f"ngram k={k}, {r}, {above}", spec, copy, {}))
            if args.device_rounds:
                device = spec | {"rounds_on_device": True}
                rows.append((f"ngram k={k}, {r} on the device, {above}", device, copy, {}))
    rows += [
        (f"{name}, Triton GEMM to {gemm_rows} rows", spec, prompts,
         {"small_batch_gemm_rows": gemm_rows})
        for gemm_rows in args.gemm_rows for name, spec, prompts, _ in rows if spec is not None
    ]  # fmt: skip
    rows *= args.passes
    if args.full:
        rows += [
            (f"draft k=3, 1 round, {above}", draft(3) | off, shakespeare, {}),
            (f"ngram k=4, 1 round, {above}", ngram | off, copy, {}),
            (f"draft k=2, {r}, {above}", draft(2) | rounds | off, shakespeare, {}),
            (f"draft k=5, {r}, {above}", draft(5) | rounds | off, shakespeare, {}),
            (f"ngram k=4, {r}, always", ngram | rounds, copy, {}),
        ]
    # plain again, last: the engines run one after another, and the GPU's state drifts
    return [*rows, ("no speculation (again, last)", None, shakespeare | copy, {})]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True, help="what `train_tiny_model.py prepare` wrote")
    parser.add_argument("--out", required=True)
    parser.add_argument("--train-seconds", type=int, default=120, help="training time limit")
    parser.add_argument("--train-steps", type=int, default=None,
                        help="training steps (default: 8 a second of --train-seconds)")  # fmt: skip
    parser.add_argument(
        "--copy-frac", type=float, default=0.5,
        help="share of the target's training windows that repeat their start (train "
        "--copy-frac; scripts/results/session25_h100.md: at 0.5 the 100-s target continues a "
        "repeated passage, greedy accuracy 0.75 on the repeat against 0.30 on its first pass)",
    )  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="the embedded model, untrained")
    parser.add_argument("--full", action="store_true", help="one-round, always-on, k=2, k=5")
    parser.add_argument("--rounds", type=int, default=8, help="num_rounds of the spec configs")
    parser.add_argument("--draft-k", type=int, default=2, help="the draft's k")
    parser.add_argument("--ngram-k", type=int, nargs="+", default=[8], help="n-gram k (a row each)")
    parser.add_argument(
        "--device-rounds", action="store_true",
        help="n-gram rows with the rounds on the device too (rounds_on_device)",
    )  # fmt: skip
    parser.add_argument(
        "--gemm-rows", type=int, nargs="*", default=[],
        help="also each speculative row with small_batch_gemm_rows at this value (a row each)",
    )  # fmt: skip
    parser.add_argument("--methods", nargs="+", choices=["draft", "ngram"],
                        default=["draft", "ngram"], help="the proposers timed")  # fmt: skip
    parser.add_argument(
        "--passes", type=int, default=2,
        help="times the plain, draft and n-gram engines run, in turn (engines of one config "
        "differ by up to 20%% from one start to the next: each row is their mean)",
    )  # fmt: skip
    parser.add_argument(
        "--disable-above", type=int, default=16,
        help="disable_by_batch_size of the configs that switch speculation off",
    )  # fmt: skip
    args = parser.parse_args()
    target = Path("/tmp/target-94m")
    if args.smoke:
        target, training = Path(ROOT / "pagedserve" / "assets" / "tiny-shakespeare"), {}
    else:
        shutil.rmtree(target, ignore_errors=True)
        training = train_target(args.data, target, args.train_seconds, args.copy_frac,
                                args.train_steps)  # fmt: skip
    print(json.dumps(training), flush=True)
    runs = []
    for name, spec, prompt_sets, engine in configs(args):
        runs += run_config(str(target), name, spec, prompt_sets, engine)
    rows = mean_rows(runs)
    add_ratios(rows)
    header = ["config", "prompts", "engines", "batch1_ms_per_token", "batch1_speedup",
              "batch64_tok_s", "batch64_vs_plain", "acceptance_rate", "mean_accepted_length",
              "num_draft_tokens", "num_accepted_tokens"]  # fmt: skip
    lines = [
        f"## Speculative decoding, {datetime.datetime.now():%Y-%m-%d %H:%M} (issue 12)",
        "",
        f"Target: the `--preset target` Llama ({training.get('params', 0) / 1e6:.1f}M "
        f"parameters, best val loss {training.get('best_val_loss')}, greedy accuracy "
        f"on held-out passages {training.get('first_pass_acc_at_best')} and on their repeat "
        f"{training.get('copy_acc_at_best')}, "
        f"{training.get('steps_run')} steps in {training.get('wall_s')} s, "
        f"{training.get('copy_frac', 0.0):.0%} of its training windows repeating their "
        "start), bf16; draft: the "
        "embedded 4M model. Batch 1: greedy, 256 tokens, median over the prompts; batch 64: "
        "64 x 256 tokens, median of 7 runs; each row the mean of its engines (run in turn), "
        "ratios against the plain rows.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    lines += ["| " + " | ".join(str(r.get(h, "")) for h in header) + " |" for r in rows]
    lines += [
        "",
        "```json",
        json.dumps({"training": training, "rows": rows, "runs": runs}, indent=1),
        "```",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[: 6 + len(rows)]))


if __name__ == "__main__":
    main()
