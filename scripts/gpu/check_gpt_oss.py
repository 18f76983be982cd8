"""GPT-OSS on the GPU: the Triton paged attention with attention sinks (and GPT-OSS's window of
128 on half the layers) against the torch reference on decode (one split and several),
chunked-prefill and mixed steps; then gpt-oss-20b's shape with dummy weights through `LLM`
(bf16, CUDA graphs), its experts MXFP4 and bf16: batch-1 time per output token and batch-64
throughput. One markdown report:

    python scripts/gpu/check_gpt_oss.py --out FILE [--skip-engine]

(Full-engine parity against transformers: `parity.py --archs gpt_oss`.)
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))

from check_windowed_attention import CASES, HEADS, TOLERANCE, make_step  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.kernels import attention_ref, triton_attention  # noqa: E402

DEVICE = torch.device("cuda")
WINDOWS = (0, 8, 128, 1000)
MODEL = ROOT / "scripts" / "gpu" / "configs" / "gpt-oss-20b"


def check() -> list[str]:
    lines = [
        "| step | dtype | window: max abs error vs the reference (sinks N(0, 2)) |",
        "|---|---|---|",
    ]
    failures = 0
    sinks = (torch.randn(HEADS, generator=torch.Generator().manual_seed(0)) * 2).to(DEVICE)
    cases = CASES | {"decode, long (split)": [(c, 1) for c in (20000, 9000, 3)]}
    for name, step_cases in cases.items():
        for dtype in (torch.float32, torch.bfloat16):
            step = make_step(step_cases, dtype, seed=len(name), head_dim=64)
            cells = []
            for window in WINDOWS:
                got = triton_attention.paged_attention_backend(
                    step["q"], step["k"], step["v"], step["metadata"], 64**-0.5,
                    window=window, sinks=sinks,
                ).float()  # fmt: skip
                want = attention_ref.paged_attention(
                    step["q"].float(), step["k"].float(), step["v"].float(), step["metadata"],
                    64**-0.5, window=window, sinks=sinks,
                )  # fmt: skip
                error = float((got - want).abs().max())
                ok = error <= TOLERANCE[dtype] and bool(torch.isfinite(got).all())
                failures += not ok
                cells.append(f"{window}: {error:.1e}{'' if ok else ' **FAIL**'}")
            lines.append(f"| {name} | {str(dtype)[6:]} | {'; '.join(cells)} |")
    lines.append(f"\n{failures} failed")
    return lines


def engine() -> list[str]:
    """gpt-oss-20b's shape, dummy bf16 weights: its experts kept MXFP4 (quantization="mxfp4":
    quantized after loading, 13 GB) and bf16 (the default: 42 GB), one engine each."""
    lines = ["| experts | batch 1: ms per output token | batch 64: output tok/s |",
             "|---|---:|---:|"]  # fmt: skip
    one = [{"prompt_token_ids": list(range(1000, 1128))}]
    batch = [{"prompt_token_ids": [t + i for t in range(1000, 1128)]} for i in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    for label, settings in (("MXFP4", {"quantization": "mxfp4"}), ("bf16", {})):
        with LLM(str(MODEL), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
                 **settings) as llm:  # fmt: skip
            seconds = []
            for prompts in (one, batch):
                llm.generate(prompts, params, use_tqdm=False)  # warm-up
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                seconds.append(time.perf_counter() - start)
        lines.append(f"| {label} | {seconds[0] * 1000 / 256:.2f} | {64 * 256 / seconds[1]:,.0f} |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name()
    report = [f"# GPT-OSS on {name}, {datetime.datetime.now():%Y-%m-%d %H:%M}\n"]
    report += ["## Attention sinks against the reference\n", *check()]
    print("\n".join(report), flush=True)
    if not args.skip_engine:
        report += [
            "\n## gpt-oss-20b shape, dummy weights, CUDA graphs, 128 in / 256 out\n",
            *engine(),
        ]
    Path(args.out).write_text("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
