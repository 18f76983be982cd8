"""Weight-layout A/B of the CUDA quantized GEMV, for kernels that take step-major weights and a
step rotation (session 36's candidate: scripts/results/session36/quant_gemv_candidate.patch;
scripts/gpu/quant_ab.sh applies it first). Three ways to read the same codes:

  rows          [N, K] codes (HEAD's layout): at each step the grid's warps read the same
                columns of their rows, rows a whole row length apart
  rows-rotated  the same codes, each warp starting at its own step (its tile index mod steps)
  steps         step-major [K / 128, N, a step's codes]: at each step the grid reads one
                contiguous span

Llama-3.1-8B projections, int4 g128 asymmetric and fp8: each layout is checked against the
dequantized reference and timed as check_quant_cuda times (bursts over weight copies beyond the
L2) at the planned config and every SWEEP config; the report has every row, the best per case
and layout, and the 32-layer sums. Exit status 1 if a check fails.

    python3 scripts/gpu/quant_layout_ab.py --out "$OUT/layout.md" [--rows 1 4]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_quant_cuda import (  # noqa: E402
    MODELS,
    SWEEP,
    TOL,
    Quantized,
    copies_for,
    make_weight,
    time_us,
    weight_bytes,
)

from pagedserve.kernels import cuda_quant, cuda_quant_plan, quant_ref  # noqa: E402
from pagedserve.kernels.cuda_quant_plan import GemvPlan  # noqa: E402

LAYOUTS = ("rows", "rows-rotated", "steps")
LAYERS = 32


def step_major(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes (int4: int32 words [N, K / 8]) -> [K / 128, N, a step's codes]."""
    n, width = codes.shape
    per_step = 16 if codes.dtype == torch.int32 else 128
    raw = codes if codes.dtype == torch.int32 else codes.view(torch.uint8)
    out = raw.view(n, width // per_step, per_step).permute(1, 0, 2).contiguous()
    return out if codes.dtype == torch.int32 else out.view(codes.dtype)


def launcher(
    w: Quantized, codes: list[torch.Tensor], x: torch.Tensor, plan: GemvPlan, rotate: bool
) -> Callable[[int], torch.Tensor]:
    """fn(i): the product on copy i, through the extension with these codes."""
    ext = cuda_quant.load_extension()
    n = w.dense.shape[0]
    geometry = (plan.warps, plan.splits, plan.k_per_split, plan.unroll, False, rotate)

    def run(i: int) -> torch.Tensor:
        out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
        copy = w.copies[i]
        if isinstance(copy, quant_ref.IntWeight):
            scheme, scales, zeros, group = "int4", copy.scales, copy.zeros, copy.group_size
        else:
            scheme, scales, zeros, group = "fp8", copy[1], None, x.shape[1]
        ext.quant_gemv(out, x, codes[i], scales, zeros, None, None, scheme, group, *geometry)
        return out

    return run


def time_case(
    w: Quantized, scheme: str, m: int, n: int, k: int, sms: int, failures: list[str]
) -> list[tuple[str, list[float]]]:
    """(config label, µs per layout) for the planned config and SWEEP's."""
    rows = [c.qweight if isinstance(c, quant_ref.IntWeight) else c[0] for c in w.copies]
    layouts = ((rows, False), (rows, True), ([step_major(c) for c in rows], False))
    x = torch.randn(m, k, device="cuda").bfloat16()
    ref = w.reference(x)
    results = []
    for config in (None, *SWEEP):
        plan = cuda_quant_plan.plan_gemv(scheme, m, n, k, sms, config)
        if plan is None:
            continue
        label = "plan" if config is None else config.describe()
        times = []
        for layout, (codes, rotate) in zip(LAYOUTS, layouts, strict=True):
            run = launcher(w, codes, x, plan, rotate)
            y = run(0)
            err = float((y.float() - ref).abs().max())
            if err > TOL[x.dtype] * float(ref.abs().max()) or not bool(y.isfinite().all()):
                failures.append(f"{scheme} {n}x{k} M={m} {label} {layout}: error {err:.3e}")
            times.append(time_us(run, len(codes)))
        results.append((label, times))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[1], help="M values")
    args = parser.parse_args()
    sms = cuda_quant.num_sms(torch.device("cuda"))
    header = " | ".join(f"{layout} µs" for layout in LAYOUTS)
    lines = [f"# Weight-layout A/B on {torch.cuda.get_device_name()}\n",
             f"| case | config | {header} | GB/s (same order) |",
             "|---|---|---:|---:|---:|---|"]  # fmt: skip
    failures: list[str] = []
    best: dict[tuple[str, str], tuple[float, str]] = {}
    for name, n, k in MODELS["llama8b"]:
        for scheme in ("int4", "fp8"):
            nbytes = weight_bytes(scheme, n, k)
            variant = "int4-asym" if scheme == "int4" else scheme
            w = make_weight(variant, n, k, torch.bfloat16, False, copies_for(nbytes))
            for m in args.rows:
                case = f"{name} {n}x{k} {scheme} M={m}"
                for label, times in time_case(w, scheme, m, n, k, sms, failures):
                    rates = " / ".join(f"{nbytes / us / 1e3:,.0f}" for us in times)
                    cells = " | ".join(f"{us:.1f}" for us in times)
                    lines.append(f"| {case} | {label} | {cells} | {rates} |")
                    for layout, us in zip(LAYOUTS, times, strict=True):
                        if (case, layout) not in best or us < best[(case, layout)][0]:
                            best[(case, layout)] = (us, label)
            del w
            torch.cuda.empty_cache()
    lines += ["", "| case | layout | best µs | config |", "|---|---|---:|---|"]
    lines += [f"| {case} | {layout} | {us:.1f} | {label} |"
              for (case, layout), (us, label) in best.items()]  # fmt: skip
    lines.append("")
    for scheme in ("int4", "fp8"):
        for m in args.rows:
            for layout in LAYOUTS:
                total = sum(us for (case, lay), (us, _) in best.items()
                            if lay == layout and case.endswith(f" {scheme} M={m}"))  # fmt: skip
                lines.append(f"- {LAYERS} layers, {scheme} M={m}, {layout}: "
                             f"{LAYERS * total / 1e3:.3f} ms")  # fmt: skip
    lines += ["", f"checks: {len(failures)} failed", *failures[:20]]
    text = "\n".join(lines)
    args.out.write_text(text)
    print(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
