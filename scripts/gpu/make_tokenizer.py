#!/usr/bin/env python3
"""A model directory for serving benchmarks with a real tokenizer at a real model's shapes.

No hub is reachable from the GPU machine, so this writes the model's config.json (the shapes;
weights are `load_format=dummy`) beside a real byte-level BPE tokenizer: the embedded model's
(4,096 tokens, trained on Shakespeare), its vocabulary grown to the model's size with seeded
word-like entries (a space and 3-9 letters; no merges produce them, so encoding is the embedded
tokenizer's, and every id the dummy model samples decodes to text). The server loads it like
any Hugging Face tokenizer: the tokenizer and detokenizer actors do their real work.

    python scripts/gpu/make_tokenizer.py scripts/gpu/configs/qwen3-0.6b /tmp/qwen3-served
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import string
from pathlib import Path

EMBEDDED = Path(__file__).resolve().parents[2] / "pagedserve" / "assets" / "tiny-shakespeare"


def build(config_dir: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(config_dir / "config.json", out / "config.json")
    vocab_size = json.loads((config_dir / "config.json").read_text())["vocab_size"]
    tokenizer = json.loads((EMBEDDED / "tokenizer.json").read_text())
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    rng = random.Random(0)
    while len(vocab) < vocab_size:  # "Ġ" is the byte-level spelling of a space
        word = "Ġ" + "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 9)))
        vocab.setdefault(word, len(vocab))
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(EMBEDDED / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config_dir", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    print(build(args.config_dir, args.out))


if __name__ == "__main__":
    main()
