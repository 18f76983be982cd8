"""One CUDA quantized GEMV launch to profile under Nsight Compute (a Llama-3.1-8B projection).

    ncu --set full --launch-skip 3 --launch-count 1 -k regex:quant_gemv_kernel \\
        python3 scripts/gpu/ncu_quant_gemv.py --scheme int4 --shape gate_up --m 1

It launches the planned kernel (or --warps / --splits / --unroll) `--launches` times on one
weight (random codes, g128 asymmetric for the int schemes), after checking the first launch
against the dequantized fp32 reference; exit status 1 if that check fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_quant_cuda import MODELS, TOL, make_weight  # noqa: E402

from pagedserve.kernels.cuda_quant_plan import GemvConfig  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", choices=("fp8", "int8", "int4"), default="int4")
    parser.add_argument("--shape", choices=[name for name, _, _ in MODELS["llama8b"]],
                        default="gate_up")  # fmt: skip
    parser.add_argument("--m", type=int, default=1)
    parser.add_argument("--warps", type=int, default=None, help="with --unroll: a forced config")
    parser.add_argument("--splits", type=int, default=None)
    parser.add_argument("--unroll", type=int, default=None)
    parser.add_argument("--launches", type=int, default=5)
    args = parser.parse_args()
    n, k = next((n, k) for name, n, k in MODELS["llama8b"] if name == args.shape)
    variant = "int4-asym" if args.scheme == "int4" else args.scheme
    w = make_weight(variant, n, k, torch.bfloat16, False)
    x = torch.randn(args.m, k, device="cuda").bfloat16()
    config = None
    if args.warps is not None and args.unroll is not None:
        config = GemvConfig(args.warps, args.splits, args.unroll)
    y = w.cuda(x, config)
    ref = w.reference(x)
    err, limit = float((y.float() - ref).abs().max()), TOL[x.dtype] * float(ref.abs().max())
    label = f"{args.scheme} {args.shape} {n}x{k} M={args.m}"
    print(f"{label}: max abs error {err:.3e} (limit {limit:.3e})")
    for _ in range(args.launches - 1):
        w.cuda(x, config)
    torch.cuda.synchronize()
    return 0 if err <= limit else 1


if __name__ == "__main__":
    sys.exit(main())
