"""The greedy argmax kernel (kernels.triton_argmax) on the GPU: the same indices as
torch.argmax on random logits and on rows with ties, across the engine's batch sizes and real
vocabularies, then µs per call (a CUDA graph of 32 calls, each a dependent launch) against
torch.argmax. Exit status 1 on any mismatch.

    python scripts/gpu/check_argmax.py [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pagedserve.kernels.triton_argmax import greedy_argmax  # noqa: E402

DEVICE = torch.device("cuda")
VOCABS = {"Llama-3.1-8B": 128256, "Qwen3-0.6B": 151936, "tiny": 1000}
ROWS = (1, 2, 7, 16, 64, 256, 1024)


def logits_with_ties(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = torch.randn(rows, vocab, device=DEVICE, generator=gen).to(dtype)
    tied = torch.randint(0, vocab, (rows, 3), device=DEVICE, generator=gen)
    logits.scatter_(1, tied, 30.0)  # three equal maxima a row: the first index must win
    return logits


def graph_us(fn, calls: int = 32) -> float:  # type: ignore[no-untyped-def]
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / 20 / calls


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    failures, checks = 0, 0
    for vocab in VOCABS.values():
        for rows in ROWS:
            for dtype in (torch.bfloat16, torch.float32):
                for logits in (logits_with_ties(rows, vocab, dtype, rows),
                               torch.randn(rows, vocab, device=DEVICE).to(dtype)):  # fmt: skip
                    out = torch.empty(rows, dtype=torch.int64, device=DEVICE)
                    for pdl in (False, True):
                        greedy_argmax(logits, out, dependent_launch=pdl)
                        checks += 1
                        failures += not torch.equal(out, logits.argmax(dim=-1))
    lines = [
        f"# Greedy argmax ({datetime.datetime.now():%Y-%m-%d %H:%M}, "
        f"{torch.cuda.get_device_name()})\n",
        f"command: `python {' '.join(sys.argv)}`\n",
        f"checks against torch.argmax: {checks - failures} of {checks} equal\n",
        "| vocabulary | rows | torch.argmax µs | split kernel µs | ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, vocab in VOCABS.items():
        for rows in (1, 8, 64, 256):
            logits = torch.randn(rows, vocab, device=DEVICE).to(torch.bfloat16)
            out = torch.empty(rows, dtype=torch.int64, device=DEVICE)
            torch_us = graph_us(lambda: out.copy_(logits.argmax(dim=-1)))  # noqa: B023
            kernel_us = graph_us(lambda: greedy_argmax(logits, out, dependent_launch=True))  # noqa: B023
            lines.append(f"| {name} ({vocab:,}) | {rows} | {torch_us:.1f} | {kernel_us:.1f} | "
                         f"{torch_us / kernel_us:.1f} |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
