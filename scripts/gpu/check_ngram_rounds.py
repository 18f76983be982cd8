#!/usr/bin/env python3
"""N-gram rounds on the device, checked on a GPU before they are timed (issue 12):

1. the Triton round kernel (kernels/triton_ngram.py) against its torch reference on CUDA
   tensors: random requests over a 4-token vocabulary (n-grams recur), random room and drafts;
2. the engine (the embedded model, CUDA graphs): greedy tokens with n-gram speculation and
   rounds (on the device) equal to those without speculation, on copy-heavy prompts.

    python scripts/gpu/check_ngram_rounds.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.kernels import triton_ngram  # noqa: E402
from pagedserve.kernels.triton_ngram import Phases, RoundsState, RowFields  # noqa: E402


def random_case(rng: np.random.Generator, batch: int, k: int, block_size: int) -> RoundsState:
    lengths = rng.integers(1, 300, size=batch)
    columns = 300 + 8 * (k + 1) + 1
    tokens = rng.integers(0, 4, size=(batch, columns))
    width = -(-columns // block_size)
    tables = rng.permutation(batch * width).reshape(batch, width).astype(np.int32)
    cuda = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
    return RoundsState(
        tokens=cuda(tokens), num_tokens=cuda(lengths), tables=cuda(tables),
        room_end=cuda(lengths + rng.integers(-1, k + 3, size=batch)),
        drafts=cuda(rng.integers(0, 4, (batch, k))),
        num_drafts=cuda(rng.integers(-1, k + 1, batch)),
    )  # fmt: skip


def check_kernel() -> int:
    rng = np.random.default_rng(0)
    failures = 0
    for _ in range(60):
        k, batch = int(rng.integers(1, 9)), int(rng.integers(1, 17))
        block_size = int(rng.choice([16, 32]))
        state = random_case(rng, batch, k, block_size)
        samples = torch.from_numpy(rng.integers(0, 4, size=batch * (k + 1))).cuda()
        outs = []
        for advance in (triton_ngram.advance_reference, triton_ngram.advance_triton):
            s = RoundsState(**{n: t.clone() for n, t in vars(state).items()})
            stats = torch.zeros(batch, k + 3, dtype=torch.int64, device="cuda")
            fields = [torch.zeros(batch * (k + 1), dtype=torch.int64, device="cuda") for _ in "abc"]
            rows = RowFields(
                *fields, torch.zeros(batch * (k + 1), dtype=torch.int32, device="cuda")
            )
            advance(s, Phases(samples, stats, rows, (2, 4)), block_size)
            drafts = [s.drafts[b, : max(int(d), 0)].tolist() for b, d in enumerate(s.num_drafts)]
            tokens = [s.tokens[b, : int(n)].tolist() for b, n in enumerate(s.num_tokens)]
            outs.append((tokens, s.num_drafts.tolist(), drafts, stats.tolist(),
                         [f.tolist() for f in vars(rows).values()]))  # fmt: skip
        failures += outs[0] != outs[1]
    print(f"kernel vs reference: {60 - failures} of 60 cases equal", flush=True)
    return failures


def check_engine(dtype: str) -> int:
    """Greedy tokens of plain, n-gram with the rounds on the host, and on the device, at
    `dtype`; the first differing index per prompt (bf16: a verify's rows and a plain decode
    run different GEMM kernels, so near-ties may flip; float32: none expected)."""
    passage = list(range(100, 160))
    prompts = [passage * 3, passage * 2 + passage[:10], list(range(300, 340))]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2, "num_rounds": 8}  # fmt: skip
    device = spec | {"rounds_on_device": True}
    variants = {"plain": {}, "host rounds": {"speculative_config": spec},
                "device rounds": {"speculative_config": device}}  # fmt: skip
    outputs = {}
    for name, extra in variants.items():
        with LLM(skip_tokenizer_init=True, max_model_len=1024, dtype=dtype, **extra) as llm:
            one = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            outputs[name] = [o.outputs[0].token_ids for o in one]
            stats = llm.get_stats()
        print(f"{dtype} {name}: drafts {stats.spec_num_draft_tokens} accepted "
              f"{stats.spec_num_accepted_tokens}", flush=True)  # fmt: skip
    failures = 0
    for name in ("host rounds", "device rounds"):
        first = [
            next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
            for x, y in zip(outputs["plain"], outputs[name])
        ]
        print(f"{dtype} {name} vs plain: first differing token per prompt {first}", flush=True)
        failures += dtype == "float32" and any(f is not None for f in first)
    return failures


if __name__ == "__main__":
    sys.exit(1 if check_kernel() + check_engine("float32") + check_engine("bfloat16") else 0)
