"""Check and time the CUDA quantized GEMV (pagedserve.kernels.cuda_quant) on one GPU (< 3 min).

    bash scripts/gpu/run.sh quant_cuda        # the install step builds csrc/ first, then this
    python3 scripts/gpu/check_quant_cuda.py --out "$OUT/quant_cuda.md"   # once built
    python3 scripts/gpu/check_quant_cuda.py --models llama8b --schemes int4 fp8 --rows 1 4 \
        --out "$OUT/quant_ab.md"   # every check, timing only these cases (a kernel A/B)
    python3 scripts/gpu/check_quant_cuda.py --time-only ...   # no checks (a known baseline)

It builds nothing: the kernel is the library `python -m pagedserve.kernels.build` made (run.sh's
install step); without it the script says why and exits 2.

1. Checks, on Llama-3.1-8B (qkv 6144x4096, o_proj 4096x4096, gate_up 28672x4096, down
   4096x14336) and Qwen3-0.6B (4096x1024, 1024x2048, 6144x1024, 1024x3072) shapes: fp8, int8
   g128 (asymmetric), int4 g128 symmetric and asymmetric, the integer schemes with and without
   an act-order permutation, M = 1, 2, 4, 8, 16, bf16 and fp16 activations (a bias at M = 4),
   against the dequantized reference in fp32 (x[:, perm].float() @ W_deq^T from the very codes,
   scales and zeros the kernel reads): max |y - ref| <= TOL[dtype] * max |ref| (bf16 2^-8, one
   ulp of the largest output; fp16 2^-10), every output finite, and two launches bit-identical.
2. Timing (bf16 x, asymmetric g128, no perm; M = 1, 4, 16): the CUDA kernel's planned launch and
   SWEEP's configs (warps, K splits, steps in flight), Triton's quantized GEMV
   (kernels.triton_quant, its tuned / default configs), the bf16 Triton GEMV
   (kernels.triton_gemv.skinny_linear) and cuBLAS (F.linear) on a bf16 weight of the shape. Each
   time is the median over ROUNDS bursts of BURST back-to-back calls between CUDA events (a spin
   kernel ahead of each burst lets the host enqueue it all), every call on the next of enough
   weight copies that a copy is read again only after > COPIES_BYTES of others: from HBM, not
   the 60 MB L2. Every swept config is checked against the reference before it is timed.
3. Report (printed last, and written to --out): checks, per case the times and GB/s of weight
   bytes (codes + scales + zeros), the winner per shape, Llama's 32-layer batch-1 projection sum,
   and a QUANT_CUDA_TUNED literal for kernels/cuda_quant_plan.py. Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pagedserve.kernels import (  # noqa: E402
    cuda_quant,
    cuda_quant_plan,
    quant_ref,
    triton_gemv,
    triton_quant,
)
from pagedserve.kernels.cuda_quant_plan import GemvConfig  # noqa: E402

MODELS = {
    "llama8b": (("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096),
                ("down", 4096, 14336)),
    "qwen0.6b": (("qkv", 4096, 1024), ("o_proj", 1024, 2048), ("gate_up", 6144, 1024),
                 ("down", 1024, 3072)),
}  # fmt: skip
CHECK_ROWS = (1, 2, 4, 8, 16)
TIME_ROWS = (1, 4, 16)
VARIANTS = ("fp8", "int8", "int4-sym", "int4-asym")
SCHEMES = ("fp8", "int8", "int4")
TOL = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}
GROUP = 128
SWEEP = [GemvConfig(w, s, u) for w in (4, 8) for s in (None, 1, 2, 4, 8) for u in (2, 4)]
ROUNDS, BURST, SLEEP_CYCLES = 5, 24, 5_000_000
COPIES_BYTES = 160_000_000
LAYERS = 32


# --------------------------------------------------------------------------- operands


@dataclass
class Quantized:
    """One weight of a variant: cuda(x, config, bias) and triton(x) on copy i, and its fp32
    dequantized form (columns in perm order)."""

    variant: str
    copies: list  # IntWeight, or (wq, w_scale)
    dense: torch.Tensor
    nbytes: int

    @property
    def perm(self) -> torch.Tensor | None:
        first = self.copies[0]
        return first.perm if isinstance(first, quant_ref.IntWeight) else None

    def cuda(self, x: torch.Tensor, config: GemvConfig | None = None,
             bias: torch.Tensor | None = None, i: int = 0) -> torch.Tensor:  # fmt: skip
        w = self.copies[i]
        if isinstance(w, quant_ref.IntWeight):
            return cuda_quant.int_weight_gemv(x, w, bias, config=config)
        return cuda_quant.fp8_weight_gemv(x, *w, bias, config=config)

    def triton(self, x: torch.Tensor, i: int = 0) -> torch.Tensor:
        w = self.copies[i]
        if isinstance(w, quant_ref.IntWeight):
            return triton_quant.int_weight_gemv(x, w)
        return triton_quant.fp8_weight_gemv(x, *w)

    def reference(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        xf = x.float() if self.perm is None else x.float()[:, self.perm]
        return F.linear(xf, self.dense, None if bias is None else bias.float())


def make_weight(variant: str, n: int, k: int, dtype: torch.dtype, perm: bool,
                copies: int = 1) -> Quantized:  # fmt: skip
    """Random codes (int: scales ~1e-3 of `dtype`, integer zeros: random, or 2^(bits-1) when
    symmetric) or an fp8-quantized N(0, 0.02) weight, and copies of it."""
    gen = torch.Generator(device="cuda").manual_seed(n * 31 + k)
    if variant == "fp8":
        wq, scale = quant_ref.quantize_fp8_rows(torch.randn(n, k, device="cuda", generator=gen))
        scale = (scale.squeeze(1) * 0.02).contiguous()
        tensors = [(wq, scale), *((wq.clone(), scale.clone()) for _ in range(copies - 1))]
        return Quantized(variant, tensors, wq.float() * scale[:, None], weight_bytes("fp8", n, k))
    bits = 4 if variant.startswith("int4") else 8
    codes = torch.randint(0, 2**bits, (n, k), device="cuda", generator=gen, dtype=torch.int32)
    scales = (torch.rand(n, k // GROUP, device="cuda", generator=gen) * 2e-3 + 5e-4).to(dtype)
    if variant == "int4-sym":
        zeros = torch.full_like(scales, 2.0 ** (bits - 1))
    else:
        zeros = torch.randint(0, 2**bits, scales.shape, device="cuda", generator=gen).to(dtype)
    order = torch.randperm(k, device="cuda", generator=gen) if perm else None
    qweight = quant_ref.pack_codes(codes, bits)
    first = quant_ref.IntWeight(qweight, scales, zeros, bits, GROUP, order)
    weights = [first, *(quant_ref.IntWeight(qweight.clone(), scales.clone(), zeros.clone(), bits,
                                            GROUP, order) for _ in range(copies - 1))]  # fmt: skip
    dense = quant_ref.dequantize_int_weight(first, torch.float32)
    return Quantized(variant, weights, dense, weight_bytes(variant[:4], n, k))


def weight_bytes(scheme: str, n: int, k: int) -> int:
    """Bytes a product reads of the weight: codes, and fp32 scales (fp8) or 16-bit scales and
    zeros (int)."""
    if scheme == "fp8":
        return n * k + 4 * n
    return n * k * (4 if scheme == "int4" else 8) // 8 + 4 * n * (k // GROUP)


def copies_for(nbytes: int) -> int:
    return max(2, min(96, -(-COPIES_BYTES // nbytes) + 1))


# --------------------------------------------------------------------------- checks


@dataclass
class Checks:
    passed: int = 0
    failures: list[str] = field(default_factory=list)

    def record(self, label: str, y: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
        err = float((y.float() - ref).abs().max())
        limit = tol * float(ref.abs().max())
        ok = err <= limit and bool(y.isfinite().all())
        if ok:
            self.passed += 1
        else:
            self.failures.append(f"{label}: max abs error {err:.3e} > {limit:.3e}")
        return ok


def run_checks(checks: Checks) -> None:
    for model, shapes in MODELS.items():
        for (name, n, k), variant in itertools.product(shapes, VARIANTS):
            for perm, dtype in itertools.product((False, True), (torch.bfloat16, torch.float16)):
                if perm and variant == "fp8":
                    continue
                w = make_weight(variant, n, k, dtype, perm)
                for m in CHECK_ROWS:
                    label = f"{model} {name} {variant}{' perm' if perm else ''} {dtype} M={m}"
                    x = torch.randn(m, k, device="cuda").to(dtype)
                    bias = torch.randn(n, device="cuda").to(dtype) if m == 4 else None
                    try:
                        y = w.cuda(x, bias=bias)
                        checks.record(label, y, w.reference(x, bias), TOL[dtype])
                        if not torch.equal(y, w.cuda(x, bias=bias)):
                            checks.failures.append(f"{label}: two launches differ")
                    except Exception as exc:  # reported, never raised
                        checks.failures.append(f"{label}: {type(exc).__name__}: {exc}"[:300])
                del w
        print(f"checks of {model}: {checks.passed} passed, {len(checks.failures)} failed",
              flush=True)  # fmt: skip


# --------------------------------------------------------------------------- timing


def time_us(fn: Callable[[int], object], copies: int) -> float:
    """Median µs of one call (see the module doc), fn(i) using copy i."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples, i = [], 0
    fn(0)
    for _ in range(ROUNDS):
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        for _ in range(BURST):
            fn(i % copies)
            i += 1
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / BURST)
    return statistics.median(samples)


@dataclass
class Case:
    model: str
    name: str
    n: int
    k: int
    scheme: str
    m: int
    nbytes: int = 0
    cuda: dict[str, float] = field(default_factory=dict)  # config label -> µs
    default: str = ""
    triton: float | None = None
    bf16_triton: float | None = None
    cublas: float | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def title(self) -> str:
        return f"{self.model} {self.name} {self.n}x{self.k} {self.scheme} M={self.m}"

    def best(self) -> tuple[str, float] | None:
        return min(self.cuda.items(), key=lambda kv: kv[1]) if self.cuda else None


def time_case(case: Case, w: Quantized, x: torch.Tensor, checks: Checks) -> None:
    copies = len(w.copies)
    ref = w.reference(x)
    sms = cuda_quant.num_sms(x.device)
    default = cuda_quant_plan.plan_gemv(case.scheme, case.m, case.n, case.k, sms)
    case.default = f"plan w{default.warps} split{default.splits} u{default.unroll}"
    for config in (None, *SWEEP):
        plan = cuda_quant_plan.plan_gemv(case.scheme, case.m, case.n, case.k, sms, config)
        if plan is None:
            continue
        label = case.default if config is None else config.describe()
        try:
            if checks.record(f"{case.title} {label}", w.cuda(x, config), ref, TOL[x.dtype]):
                case.cuda[label] = time_us(lambda i, c=config: w.cuda(x, c, i=i), copies)
        except Exception as exc:
            case.errors.append(f"{label}: {type(exc).__name__}: {exc}"[:200])
    try:
        case.triton = time_us(lambda i: w.triton(x, i), copies)
    except Exception as exc:
        case.errors.append(f"triton: {type(exc).__name__}: {exc}"[:200])


def time_bf16(case: Case, weights: list[torch.Tensor], x: torch.Tensor) -> None:
    copies = len(weights)
    case.bf16_triton = time_us(lambda i: triton_gemv.skinny_linear(x, weights[i]), copies)
    case.cublas = time_us(lambda i: F.linear(x, weights[i]), copies)


@dataclass(frozen=True)
class TimingScope:
    """What the timing phase covers (the command line's filters)."""

    models: tuple[str, ...]
    schemes: tuple[str, ...]
    rows: tuple[int, ...]


def run_timing(checks: Checks, deadline: float, scope: TimingScope) -> tuple[list[Case], list[str]]:
    cases, skipped = [], []
    for model in scope.models:
        for name, n, k in MODELS[model]:
            w_bf16 = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
            dense = [w_bf16, *(w_bf16.clone() for _ in range(copies_for(n * k * 2) - 1))]
            xs = {m: torch.randn(m, k, device="cuda").bfloat16() for m in scope.rows}
            bf16: dict[int, Case] = {}
            for scheme in scope.schemes:
                variant = "int4-asym" if scheme == "int4" else scheme
                copies = copies_for(weight_bytes(scheme, n, k))
                w = make_weight(variant, n, k, torch.bfloat16, False, copies)
                for m in scope.rows:
                    case = Case(model, name, n, k, scheme, m, w.nbytes)
                    if time.perf_counter() > deadline:
                        skipped.append(case.title)
                        continue
                    time_case(case, w, xs[m], checks)
                    if m not in bf16:
                        bf16[m] = case
                        time_bf16(case, dense, xs[m])
                    case.bf16_triton, case.cublas = bf16[m].bf16_triton, bf16[m].cublas
                    cases.append(case)
                    best = case.best()
                    print(f"{case.title}: best {best[1]:.1f} µs ({best[0]})" if best else
                          f"{case.title}: no result {case.errors[:1]}", flush=True)  # fmt: skip
                del w
            del dense, w_bf16
            torch.cuda.empty_cache()
    return cases, skipped


# --------------------------------------------------------------------------- report


def fmt(us: float | None) -> str:
    return "-" if us is None else f"{us:.1f}"


def gbps(case: Case, us: float | None) -> str:
    return "-" if us is None else f"{case.nbytes / us / 1e3:,.0f}"


def summary(cases: list[Case]) -> list[str]:
    lines = ["## Per shape (bf16 x, g128 asymmetric, no perm)\n",
             "| case | MB | CUDA plan µs | GB/s | CUDA best µs | GB/s | best config | "
             "Triton quant µs | bf16 Triton µs | cuBLAS µs | Triton / CUDA best |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for c in cases:
        best = c.best()
        plan = c.cuda.get(c.default)
        ratio = f"{c.triton / best[1]:.2f}" if best and c.triton else "-"
        lines.append(
            f"| {c.title} | {c.nbytes / 1e6:.1f} | {fmt(plan)} | {gbps(c, plan)} | "
            f"{fmt(best and best[1])} | {gbps(c, best and best[1])} | {best[0] if best else '-'} | "
            f"{fmt(c.triton)} | {fmt(c.bf16_triton)} | {fmt(c.cublas)} | {ratio} |"
        )
    return [*lines, ""]


def layer_sums(cases: list[Case]) -> list[str]:
    """Llama-3.1-8B, M = 1: LAYERS x the four projections (no LM head), per scheme."""
    lines = [f"Llama-3.1-8B batch 1, {LAYERS} layers x (qkv + o_proj + gate_up + down), ms:\n"]
    for scheme in SCHEMES:
        ones = [c for c in cases if c.model == "llama8b" and c.scheme == scheme and c.m == 1]
        if len(ones) < len(MODELS["llama8b"]) or not all(c.best() for c in ones):
            continue
        plan = sum(c.cuda.get(c.default, float("nan")) for c in ones)
        best = sum(c.best()[1] for c in ones)
        triton = sum(c.triton or float("nan") for c in ones)
        bf16 = sum(c.bf16_triton or float("nan") for c in ones)
        lines.append(f"- {scheme}: CUDA plan {LAYERS * plan / 1e3:.3f}, CUDA best "
                     f"{LAYERS * best / 1e3:.3f}, Triton quant {LAYERS * triton / 1e3:.3f}, "
                     f"bf16 Triton GEMV {LAYERS * bf16 / 1e3:.3f}")  # fmt: skip
    return [*lines, ""]


def tuned_literal(cases: list[Case], num_sms: int) -> list[str]:
    """The winners at least 3% faster than the plan, as QUANT_CUDA_TUNED entries (M bucket 8
    from the M = 1 and 4 cases: the faster of the two is kept; 16 from M = 16)."""
    picks: dict[tuple, tuple[float, str, str]] = {}
    for c in cases:
        best, plan = c.best(), c.cuda.get(c.default)
        if best is None or plan is None or best[1] > 0.97 * plan or best[0] == c.default:
            continue
        key = (num_sms, c.scheme, 8 if c.m <= 8 else 16, c.n, c.k)
        gain = best[1] / plan
        if key not in picks or gain < picks[key][0]:
            picks[key] = (gain, best[0], f"{c.title}: {plan:.1f} -> {best[1]:.1f} µs")
    lines = ["## QUANT_CUDA_TUNED (paste into pagedserve/kernels/cuda_quant_plan.py)\n",
             "```python",
             "QUANT_CUDA_TUNED: dict[tuple[int, str, int, int, int], GemvConfig] = {"]  # fmt: skip
    for key, (_gain, label, note) in picks.items():
        warps, split, unroll = label.split()
        splits = split.removeprefix("split")
        splits = "None" if splits == "auto" else splits
        sms, scheme, bucket, n, k = key
        lines += [f"    # {note}",
                  f'    ({sms}, "{scheme}", {bucket}, {n}, {k}): '
                  f"GemvConfig({warps[1:]}, {splits}, {unroll[1:]}),"]  # fmt: skip
    return [*lines, "}", "```", ""]


def report(header: list[str], checks: Checks, cases: list[Case], skipped: list[str],
           num_sms: int) -> str:  # fmt: skip
    body = [*header, "## Checks\n",
            f"{checks.passed} passed, {len(checks.failures)} failed "
            "(tolerance: bf16 2^-8, fp16 2^-10 of max |ref|; relaunch identical)\n"]  # fmt: skip
    body += [f"- FAIL {line}" for line in checks.failures[:40]] + [""]
    errors = [f"- {c.title}: {e}" for c in cases for e in c.errors]
    if errors:
        body += ["Launch errors:\n", *errors[:40], ""]
    if skipped:
        body.append("Skipped (time limit): " + ", ".join(skipped) + "\n")
    body += [*layer_sums(cases), *tuned_literal(cases, num_sms), *summary(cases)]
    return "\n".join(body)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="markdown report path")
    parser.add_argument("--time-limit", type=float, default=150.0, help="s before timing stops")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=tuple(MODELS),
        default=tuple(MODELS),
        help="models whose shapes are timed (all are checked)",
    )
    parser.add_argument(
        "--schemes",
        nargs="+",
        choices=SCHEMES,
        default=SCHEMES,
        help="schemes timed (all are checked)",
    )
    parser.add_argument("--rows", nargs="+", type=int, default=TIME_ROWS, help="M values timed")
    parser.add_argument(
        "--time-only", action="store_true", help="skip the checks phase (a baseline's timing)"
    )
    args = parser.parse_args()
    scope = TimingScope(tuple(args.models), tuple(args.schemes), tuple(args.rows))
    started = time.perf_counter()
    try:
        cuda_quant.load_extension()
    except ImportError as exc:
        print(f"the CUDA quantized GEMV is not available: {exc}")
        return 2
    num_sms = cuda_quant.num_sms(torch.device("cuda"))
    command = " ".join(["python3 scripts/gpu/check_quant_cuda.py", *sys.argv[1:]])
    header = [f"# CUDA quantized GEMV on {torch.cuda.get_device_name()}\n",
              f"{datetime.datetime.now():%Y-%m-%d %H:%M}, torch {torch.__version__}, {num_sms} "
              f"SMs; `{command}`; µs: median of {ROUNDS} bursts of {BURST} calls over "
              f"weight copies rotated beyond {COPIES_BYTES / 1e6:.0f} MB; GB/s: weight bytes "
              "/ time\n"]  # fmt: skip
    checks = Checks()
    if not args.time_only:
        run_checks(checks)
    print(f"checks done in {time.perf_counter() - started:.0f} s", flush=True)
    cases, skipped = run_timing(checks, started + args.time_limit, scope)
    header.append(f"total {time.perf_counter() - started:.0f} s\n")
    text = report(header, checks, cases, skipped, num_sms)
    if args.out:
        args.out.write_text(text)
    print(text, flush=True)
    return 1 if checks.failures else 0


if __name__ == "__main__":
    sys.exit(main())
