"""The CUDA quantized GEMV on its two weight layouts, rows and warp tiles (< 2 min on one GPU).

    python3 scripts/gpu/quant_tiles_probe.py --out "$OUT/tiles.md"      # checks, then timing
    ncu --clock-control none --section SpeedOfLight ... -k regex:quant_gemv \
        python3 scripts/gpu/quant_tiles_probe.py --ncu                  # one launch of each

Rows: the codes of each weight row contiguous ([N, K / 8] int32 or [N, K] bytes); a warp's
load reads 64 (int4) or 128 bytes of each of 8 rows. Tiles (quant_ref.tile_codes, w_tiled in
csrc/quant_gemv.h): the same bytes in the order the warps read them, every load 512 contiguous
bytes. Same kernel, same lanes, same sums: the outputs must be bit-identical.

1. Checks on the Llama-3.1-8B projections (fp8, int8 g128, int4 g128; M = 1, 4, 16, bf16 x):
   tiles against rows (torch.equal) and rows against the dequantized fp32 reference
   (check_quant_cuda's tolerance).
2. Timing (check_quant_cuda.time_us: bursts over weight copies beyond the L2), M = 1 and 4:
   the planned launch and check_quant_cuda's SWEEP (int4: also rings of 8) on each layout, the
   bf16 Triton GEMV.
3. Report: per shape, and the 32-layer sums at M = 1 (ms).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_quant_cuda as cq  # noqa: E402

from pagedserve.kernels import cuda_quant, cuda_quant_plan, quant_ref, triton_gemv  # noqa: E402
from pagedserve.kernels.cuda_quant_plan import GemvConfig  # noqa: E402

SHAPES = cq.MODELS["llama8b"]
SCHEMES = ("fp8", "int4", "int8")
CHECK_ROWS = (1, 4, 16)
TIME_ROWS = (1, 4)
LAYOUTS = ("rows", "tiles")


@dataclass
class Weights:
    """A quantized weight's copies in both layouts; run(x, layout, i, config) multiplies."""

    q: cq.Quantized
    tiled: list = field(default_factory=list)

    def run(
        self, x: torch.Tensor, layout: str, i: int = 0, config: GemvConfig | None = None
    ) -> torch.Tensor:
        tiled = layout == "tiles"
        w = (self.tiled if tiled else self.q.copies)[i]
        if isinstance(w, quant_ref.IntWeight):
            return cuda_quant.int_weight_gemv(x, w, config=config, tiled=tiled)
        return cuda_quant.fp8_weight_gemv(x, *w, config=config, tiled=tiled)


def make(scheme: str, n: int, k: int, copies: int) -> Weights:
    variant = "int4-asym" if scheme == "int4" else scheme
    q = cq.make_weight(variant, n, k, torch.bfloat16, False, copies)
    w = Weights(q)
    for c in q.copies:
        if isinstance(c, quant_ref.IntWeight):
            w.tiled.append(quant_ref.IntWeight(quant_ref.tile_codes(c.qweight), c.scales,
                                               c.zeros, c.bits, c.group_size))  # fmt: skip
        else:
            w.tiled.append((quant_ref.tile_codes(c[0]), c[1]))
    return w


def check(failures: list[str]) -> int:
    passed = 0
    for (name, n, k), scheme in ((s, c) for s in SHAPES for c in SCHEMES):
        w = make(scheme, n, k, 1)
        for m in CHECK_ROWS:
            x = torch.randn(m, k, device="cuda").bfloat16()
            rows, tiles = w.run(x, "rows"), w.run(x, "tiles")
            ref = w.q.reference(x)
            err = float((rows.float() - ref).abs().max())
            label = f"{name} {scheme} M={m}"
            if not torch.equal(rows, tiles):
                failures.append(f"{label}: tiles differ from rows")
            elif err > cq.TOL[torch.bfloat16] * float(ref.abs().max()):
                failures.append(f"{label}: rows error {err:.3e}")
            else:
                passed += 1
        del w
    return passed


@dataclass
class Case:
    name: str
    n: int
    k: int
    scheme: str
    m: int
    nbytes: int
    plan: dict[str, float] = field(default_factory=dict)  # layout -> µs
    best: dict[str, tuple[float, str]] = field(default_factory=dict)  # layout -> (µs, config)
    bf16: float = 0.0


def sweep(scheme: str) -> list[GemvConfig]:
    """check_quant_cuda's configs, and for int4 the same with rings of 8 steps."""
    rings = [GemvConfig(c.warps, c.splits, 8) for c in cq.SWEEP if c.unroll == 4]
    return [*cq.SWEEP, *(rings if scheme == "int4" else [])]


def time_case(case: Case, w: Weights, x: torch.Tensor) -> None:
    copies = len(w.tiled)
    sms = cuda_quant.num_sms(x.device)
    for layout in LAYOUTS:
        for config in (None, *sweep(case.scheme)):
            if cuda_quant_plan.plan_gemv(case.scheme, case.m, case.n, case.k, sms, config) is None:
                continue
            us = cq.time_us(lambda i, c=config, lay=layout: w.run(x, lay, i, c), copies)
            if config is None:
                case.plan[layout] = us
            label = "plan" if config is None else config.describe()
            if layout not in case.best or us < case.best[layout][0]:
                case.best[layout] = (us, label)


def run_timing() -> list[Case]:
    cases = []
    for name, n, k in SHAPES:
        dense = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16()]
        dense += [dense[0].clone() for _ in range(cq.copies_for(n * k * 2) - 1)]
        for scheme in SCHEMES:
            w = make(scheme, n, k, cq.copies_for(cq.weight_bytes(scheme, n, k)))
            for m in TIME_ROWS:
                x = torch.randn(m, k, device="cuda").bfloat16()
                case = Case(name, n, k, scheme, m, w.q.nbytes)
                time_case(case, w, x)
                case.bf16 = cq.time_us(lambda i, x=x, d=dense: triton_gemv.skinny_linear(x, d[i]),
                                       len(dense))  # fmt: skip
                cases.append(case)
                print(f"{name} {scheme} M={m}: rows {case.best['rows']}, tiles "
                      f"{case.best['tiles']}", flush=True)  # fmt: skip
            del w
        torch.cuda.empty_cache()
    return cases


def report(header: list[str], passed: int, failures: list[str], cases: list[Case]) -> str:
    lines = [*header, f"checks: {passed} passed, {len(failures)} failed\n"]
    lines += [f"- FAIL {f}" for f in failures[:20]]
    lines += ["", "| case | MB | rows plan µs | rows best µs (config) | GB/s | tiles plan µs | "
              "tiles best µs (config) | GB/s | tiles / rows | bf16 Triton GEMV µs |",
              "|---|---:|---:|---|---:|---:|---|---:|---:|---:|"]  # fmt: skip
    for c in cases:
        (r, rc), (t, tc) = c.best["rows"], c.best["tiles"]
        lines.append(f"| {c.name} {c.n}x{c.k} {c.scheme} M={c.m} | {c.nbytes / 1e6:.1f} | "
                     f"{c.plan['rows']:.1f} | {r:.1f} ({rc}) | {c.nbytes / r / 1e3:,.0f} | "
                     f"{c.plan['tiles']:.1f} | {t:.1f} ({tc}) | {c.nbytes / t / 1e3:,.0f} | "
                     f"{t / r:.2f} | {c.bf16:.1f} |")  # fmt: skip
    lines += ["", f"Llama-3.1-8B M = 1, {cq.LAYERS} layers x 4 projections, ms "
              "(plan / best of sweep):", ""]  # fmt: skip
    for scheme in SCHEMES:
        ones = [c for c in cases if c.scheme == scheme and c.m == 1]
        parts = []
        for layout in LAYOUTS:
            plan = cq.LAYERS * sum(c.plan[layout] for c in ones) / 1e3
            best = cq.LAYERS * sum(c.best[layout][0] for c in ones) / 1e3
            parts.append(f"{layout} {plan:.3f} / {best:.3f}")
        bf16 = cq.LAYERS * sum(c.bf16 for c in ones) / 1e3
        lines.append(f"- {scheme}: {', '.join(parts)}; bf16 Triton GEMV {bf16:.3f}")
    return "\n".join([*lines, ""])


def ncu_launches() -> None:
    """One warm launch of each layout, int4 and fp8 gate_up and down at M = 1 (for ncu)."""
    for (name, n, k), scheme in ((s, c) for s in SHAPES[2:] for c in ("int4", "fp8")):
        w = make(scheme, n, k, 1)
        x = torch.randn(1, k, device="cuda").bfloat16()
        for layout in LAYOUTS:
            w.run(x, layout)
            torch.cuda.synchronize()
            print(f"ncu launch: {name} {scheme} {layout}", flush=True)
            w.run(x, layout)
            torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--ncu", action="store_true", help="only the launches to profile")
    args = parser.parse_args()
    cuda_quant.load_extension()
    if args.ncu:
        ncu_launches()
        return 0
    header = [f"# CUDA quantized GEMV, rows vs tiles, {torch.cuda.get_device_name()}\n",
              f"{datetime.datetime.now():%Y-%m-%d %H:%M}, torch {torch.__version__}; "
              "`python3 scripts/gpu/quant_tiles_probe.py`; bf16 x, g128 asym. (int)\n"]  # fmt: skip
    failures: list[str] = []
    passed = check(failures)
    print(f"checks: {passed} passed, {len(failures)} failed", flush=True)
    text = report(header, passed, failures, run_timing())
    if args.out:
        args.out.write_text(text)
    print(text, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
