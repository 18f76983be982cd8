"""Tune the skinny weight-streaming GEMM (pagedserve.kernels.triton_gemv.skinny_linear) per
projection shape on one GPU: time candidate launch configs against cuBLAS, print the best per
shape and a SKINNY_TUNED literal to paste into triton_gemv.py.

    python3 scripts/gpu/sweep_gemv.py --out "$OUT/sweep_gemv.md"  # H200, M = 1: ~1.5-2 min
    python3 scripts/gpu/sweep_gemv.py --m 1 2 4 --out ...         # also the M = 2 and 4 buckets
    python3 scripts/gpu/sweep_gemv.py --dry-run                   # CPU: grid, plans, checks

Needs only torch and triton (the kernel modules import alone on a bare GPU image). SKINNY_TUNED
keys an M bucket (1, 2, 4, 16) by its largest M: sweep that M (--m 1 2 4 16).

Shapes: the projections a decode step streams (bench_kernels.projection_shapes: qkv, o_proj,
gate_up, down, lm_head) of Llama-3.1-8B and Qwen3-0.6B, bf16, weights ~N(0, 0.02), x ~N(0, 1).

Search, per (M, shape); every candidate is a SkinnyConfig forced through
`skinny_linear(..., config=...)`, and candidates that resolve to the same launch plan (blocks
clamped to the problem, splits clamped to the K chunks) are timed once:
  1. blocks: every FMA_BLOCKS entry (block_n, block_k, num_warps; DOT_BLOCKS for M > 4) with
     the automatic K split and the default weight-load hints;
  2. K splits: the `--top` fastest so far with each of SPLITS forced;
  3. load hints: the `--top` fastest so far with each of LOAD_HINTS (cache modifier, eviction
     policy of the weight loads);
  4. confirmation: the `--top` fastest, the current plan (what the engine launches today:
     SKINNY_TUNED, else SKINNY_TUNING) and cuBLAS re-timed in interleaved rounds; the best
     confirmed config wins.
The shapes N, K and the split count are runtime arguments: one Triton compile per constexpr set
(blocks, warps, stages, hints, and whether K divides into BLOCK_K and whether K is split) serves
every shape; `--dry-run` counts them.

Correctness: each candidate's first result against F.linear in fp32 (unrounded): max abs error
at most max(one bf16 ulp of the largest output, cuBLAS's own max abs error), at most
MAX_MISMATCH of the outputs differing from the fp32 result rounded once (an fp32-accumulating,
once-rounding kernel differs only by summation order: ~0.1 %), all finite. A failing candidate
is reported and never picked; the run then exits 1.

Timing: a CUDA graph of max(--calls, copies) calls, each on the next of `copies` weight copies
(random, different data), replayed; µs = median replay time / calls. The copies hold at least
--l2-multiple x the L2 size (50 MB on an H200) in all, so every call streams its weight from HBM
(Llama qkv is 50 MB, o_proj 33 MB: one buffer would be partly served from L2), and x stays in
L2 as in a decode step. Back-to-back kernels, as in a CUDA-graph decode step: the launch gaps
are included, no L2 flush in between (bench_kernels' timer subtracts a flush instead, so its
numbers differ a little). GB/s counts the weight bytes only.

Output (printed, and written to --out with a JSON of every measurement beside it): per shape
the fastest configs, the current plan and cuBLAS (µs, GB/s, ratios, errors); a best-config
table; per-model sums per decoder layer and per token; and the SKINNY_TUNED literal (entries
that beat the current plan by at least --min-gain). Plugging in: paste the literal over
SKINNY_TUNED in pagedserve/kernels/triton_gemv.py (keys carry the SM count: other GPUs keep the
defaults), then rerun this script (the "current" rows should match the "best" ones) and
`bench_kernels.py --only gemv`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import math
import os
import statistics
import sys
import textwrap
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import bench_kernels  # noqa: E402  (MODELS, projection_shapes, import_package)

# the speculative benchmark's target (train_tiny_model.py's `target` preset, the embedded
# tokenizer's vocabulary): its verify steps run 2-16 rows through these shapes
TARGET_94M = bench_kernels.Model("target-94m", 10, 5, 64, 640, 1728, 4096)
SWEEP_MODELS = [*bench_kernels.MODELS, TARGET_94M]

# (block_n, block_k, num_warps) of the fma inner loop (M <= 4): W tiles of 2-16 KB a K step,
# 16-128 fp32 accumulators a thread at M = 1 (block_m * block_n * block_k / (32 * num_warps)),
# block_k >= 8 * 32 * num_warps where possible (every thread one 16-byte load a row). First: the
# SKINNY_TUNING default for M = 1.
FMA_BLOCKS: tuple[tuple[int, int, int], ...] = (
    (4, 1024, 4),
    (1, 1024, 1),
    (2, 1024, 1),
    (8, 256, 1),
    (16, 256, 1),
    (1, 2048, 2),
    (2, 1024, 2),
    (4, 512, 2),
    (4, 1024, 2),
    (8, 512, 2),
    (1, 2048, 4),
    (1, 4096, 4),
    (2, 1024, 4),
    (2, 2048, 4),
    (8, 1024, 4),
    (1, 4096, 8),
    (2, 2048, 8),
    (2, 4096, 8),
    (4, 2048, 8),
)
FMA_MAX_ACC = 64  # M > 1: fp32 accumulators a thread, at most (see fma_blocks)
# (block_n, block_k, num_warps, num_stages) of the dot inner loop (M > 4); first: the default.
DOT_BLOCKS: tuple[tuple[int, int, int, int], ...] = (
    (32, 128, 4, 4),
    (16, 128, 4, 4),
    (16, 256, 4, 4),
    (16, 512, 4, 3),
    (32, 256, 4, 3),
    (64, 128, 4, 4),
    (32, 64, 2, 6),
    (16, 256, 2, 4),
    (32, 128, 2, 4),
    (64, 256, 8, 3),
)
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)
# (cache modifier, eviction policy) of the weight loads; first: the kernel's default. A cache
# modifier excludes an eviction policy (ptxas rejects the pair; check_skinny_config too).
LOAD_HINTS = (("", "evict_first"), ("", ""), (".cg", ""))
MAX_MISMATCH = 0.05
LAYERS = {"qwen3-0.6b": 28, "llama-3.1-8b": 32}
# --dry-run: tiny shapes through the Triton interpreter (K tails: 1040 = 1024 + 16)
DRY_SHAPES = (("tiny", "a", 8, 1040), ("tiny", "b", 6, 2560))
H200_SMS = 132


@dataclass(frozen=True)
class Shape:
    model: str
    name: str
    n: int
    k: int

    def label(self, m: int) -> str:
        return f"{self.model} {self.name} M={m} {self.n}x{self.k}"


@dataclass
class Result:
    """One candidate on one (M, shape): `config` None with label "current" is the plan the
    engine picks today; label "cublas" is F.linear."""

    label: str
    stage: str
    config: object | None = None  # SkinnyConfig
    plan: object | None = None  # SkinnyPlan
    us: float | None = None  # screening time
    confirm_us: list[float] = field(default_factory=list)
    first_call_s: float = 0.0  # the first call: the Triton compile, if new
    abs_err: float | None = None
    ulp_err: float | None = None
    mismatch: float | None = None
    ok: bool = True
    error: str = ""

    @property
    def best_us(self) -> float | None:
        """The confirmed time (median of the rounds) if confirmed, else the screening time."""
        return statistics.median(self.confirm_us) if self.confirm_us else self.us

    def describe(self) -> str:
        if self.label == "cublas":
            return "cuBLAS (F.linear)"
        text = self.plan.describe() if self.plan is not None else "?"
        return f"current: {text}" if self.label == "current" else text

    def check_text(self) -> str:
        if self.error:
            return "error: " + " ".join(self.error.split())[:120]
        if self.abs_err is None:
            return "-"
        text = f"err {self.abs_err:.1e} ({self.ulp_err:.0f} ulp), {100 * self.mismatch:.2f}% off"
        return text if self.ok else "FAIL " + text


# --------------------------------------------------------------------------- imports


def load_gemv(dry_run: bool) -> types.ModuleType:
    """pagedserve.kernels.triton_gemv; under the Triton interpreter for a dry run (the variable
    must be set before triton is imported)."""
    if dry_run:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print("note: triton was imported before TRITON_INTERPRET=1 could be set")
        os.environ["TRITON_INTERPRET"] = "1"
    bench_kernels.import_package()
    return importlib.import_module("pagedserve.kernels.triton_gemv")


# --------------------------------------------------------------------------- candidates


def bucket_max_m(tg: types.ModuleType, m: int) -> int:
    return next(c.max_m for c in tg.SKINNY_TUNING if m <= c.max_m)


def block_configs(tg: types.ModuleType, m: int) -> list:
    """Stage 1: the block shapes for M rows, automatic split, default load hints."""
    base = next(c for c in tg.SKINNY_TUNING if m <= c.max_m)
    if m > 4:
        configs = [
            tg.SkinnyConfig(m, True, bn, bk, warps, stages) for bn, bk, warps, stages in DOT_BLOCKS
        ]
    else:
        configs = [tg.SkinnyConfig(m, False, bn, bk, warps, 1) for bn, bk, warps in fma_blocks(m)]
    default = dataclasses.replace(base, max_m=m)
    return [default] + [c for c in configs if c != default]


def fma_blocks(m: int) -> list[tuple[int, int, int]]:
    """FMA_BLOCKS for M rows: M = 1 as listed; M > 1 halves block_n, then block_k, until a
    thread holds at most FMA_MAX_ACC accumulators (x rows pad to a power of two), keeping
    tiles of at least one 16-byte vector a thread."""
    block_m = 1 << (m - 1).bit_length()
    blocks = []
    for bn, bk, warps in FMA_BLOCKS:
        while m > 1 and block_m * bn * bk > FMA_MAX_ACC * 32 * warps:
            bn, bk = (bn // 2, bk) if bn > 1 else (bn, bk // 2)
        if bn * bk >= 8 * 32 * warps and (bn, bk, warps) not in blocks:
            blocks.append((bn, bk, warps))
    return blocks


def split_configs(configs: Sequence) -> list:
    return [dataclasses.replace(c, split_k=s) for c in configs for s in SPLITS]


def hint_configs(configs: Sequence) -> list:
    return [
        dataclasses.replace(c, w_cache=cache, w_evict=evict)
        for c in configs
        for cache, evict in LOAD_HINTS
    ]


def wasteful(plan: object) -> bool:
    """fma tiles smaller than one 16-byte vector a thread (the warps would load the same
    elements twice): a clamped block on a short problem, never faster."""
    return not plan.use_dot and plan.block_n * plan.block_k < 8 * 32 * plan.num_warps


def compile_key(plan: object, m: int, k: int) -> tuple:
    """The constexpr set (and M == 1, which Triton specializes) one compile serves."""
    return (
        plan.use_dot,
        plan.block_m,
        plan.block_n,
        plan.block_k,
        k % plan.block_k == 0,
        plan.split_k > 1,
        plan.num_warps,
        plan.num_stages,
        plan.w_cache,
        plan.w_evict,
        m == 1,
    )


def pinned(
    tg: types.ModuleType, config: object, plan: object, m: int, n: int, k: int, num_sms: int
) -> object:
    """config with the plan's clamped blocks and its split count spelled out (a SKINNY_TUNED
    entry independent of the split heuristic), if that gives the same plan again."""
    fixed = dataclasses.replace(
        config,
        max_m=bucket_max_m(tg, m),
        block_n=plan.block_n,
        block_k=plan.block_k,
        split_k=plan.split_k,
    )
    if tg.plan_skinny_linear(m, n, k, num_sms, config=fixed) == plan:
        return fixed
    return dataclasses.replace(fixed, split_k=config.split_k)


def config_literal(config: object) -> str:
    """SkinnyConfig(...) with positional arguments in field order (one short line; ruff-format
    style: double quotes)."""
    values = [json.dumps(v) if isinstance(v, str) else repr(v) for v in dataclasses.astuple(config)]
    return f"SkinnyConfig({', '.join(values)})"


# --------------------------------------------------------------------------- timing


class GraphTimer:
    """µs per call: a CUDA graph of `calls` calls cycling over the weight copies, replayed;
    the median of `replays` timed replays (after one warm replay) / calls."""

    def __init__(self, calls: int, replays: int) -> None:
        self.calls, self.replays = calls, replays

    def __call__(self, fns: Sequence[Callable[[], object]], replays: int | None = None) -> float:
        calls = len(fns) * math.ceil(max(self.calls, len(fns)) / len(fns))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fn in fns[:2]:
                fn()  # the allocator warm on a side stream, as capture requires
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fns[i % len(fns)]()
        graph.replay()
        times = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(replays or self.replays):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        del graph
        return 1e3 * statistics.median(times) / calls


class WallTimer:
    """--dry-run: wall-clock µs of one eager pass over the copies (meaningless numbers; the
    flow is what is tested)."""

    def __call__(self, fns: Sequence[Callable[[], object]], replays: int | None = None) -> float:
        start = time.perf_counter()
        for fn in fns:
            fn()
        return 1e6 * (time.perf_counter() - start) / len(fns)


# --------------------------------------------------------------------------- one shape


@dataclass
class Context:
    tg: types.ModuleType
    device: torch.device
    dtype: torch.dtype
    num_sms: int
    timer: Callable
    args: argparse.Namespace
    deadline: float
    compile_keys: set = field(default_factory=set)
    first_call_s: float = 0.0


def weight_copies(ctx: Context, shape: Shape) -> list[torch.Tensor]:
    """Enough random copies of the [N, K] weight that together they exceed --l2-multiple x L2."""
    nbytes = shape.n * shape.k * torch.empty(0, dtype=ctx.dtype).element_size()
    copies = 1
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        l2 = getattr(props, "L2_cache_size", 0) or 50 * 2**20
        copies = max(1, math.ceil(ctx.args.l2_multiple * l2 / nbytes))
    gen = torch.Generator(device=ctx.device).manual_seed(shape.n * 7 + shape.k)
    return [
        (torch.randn(shape.n, shape.k, generator=gen, device=ctx.device) * 0.02).to(ctx.dtype)
        for _ in range(copies)
    ]


def reference32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear in fp32 (IEEE: TF32 off), unrounded, in row chunks (no fp32 copy of a 1 GB
    weight)."""
    x32 = x.float()
    parts = [
        torch.nn.functional.linear(x32, weight[start : start + 16384].float())
        for start in range(0, weight.shape[0], 16384)
    ]
    return torch.cat(parts, dim=-1)


def errors(out: torch.Tensor, ref32: torch.Tensor) -> tuple[float, float, float]:
    """(max |out - ref|, max error in ulps of out's dtype against ref rounded once, fraction
    of outputs unequal to ref rounded once); inf if out has a non-finite value."""
    out32 = out.float()
    if not bool(torch.isfinite(out32).all()):
        return math.inf, math.inf, 1.0
    rounded = ref32.to(out.dtype).float()
    _, exponent = torch.frexp(rounded)
    mantissa = {torch.bfloat16: 8, torch.float16: 11}[out.dtype]
    ulp = torch.ldexp(torch.ones_like(rounded), exponent - mantissa)
    abs_err = float((out32 - ref32).abs().max())
    ulp_err = float(((out32 - rounded).abs() / ulp).max())
    return abs_err, ulp_err, float((out32 != rounded).float().mean())


def run_candidate(
    ctx: Context, result: Result, fns: list, ref32: torch.Tensor, tolerance: float | None
) -> None:
    """Check the first call against ref32 (gated by `tolerance` unless None), then time it.
    Any exception is recorded in the result."""
    try:
        start = time.perf_counter()
        out = fns[0]()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        result.first_call_s = time.perf_counter() - start
        ctx.first_call_s += result.first_call_s
        result.abs_err, result.ulp_err, result.mismatch = errors(out, ref32)
        if tolerance is not None:
            result.ok = result.abs_err <= tolerance and result.mismatch <= MAX_MISMATCH
        if result.ok:
            result.us = ctx.timer(fns)
    except Exception as exc:  # noqa: BLE001 - report in the result, go on with the others
        result.error = f"{type(exc).__name__}: {exc}"
        result.ok = result.label == "cublas"  # an error of ours is a failure
        if ctx.device.type == "cuda":
            try:
                torch.cuda.synchronize()
            except Exception as sync_exc:  # noqa: BLE001 - a sticky error: later rows fail
                print(f"  (synchronize: {type(sync_exc).__name__}: {str(sync_exc)[:200]})")


def sweep_shape(ctx: Context, m: int, shape: Shape) -> dict:
    """Stages 1-4 on one (M, shape): {"results": [Result], "best": Result, ...}."""
    tg, args = ctx.tg, ctx.args
    weights = weight_copies(ctx, shape)
    print(f"{shape.label(m)}: {len(weights)} weight copies", flush=True)
    gen = torch.Generator(device=ctx.device).manual_seed(m * 1000 + shape.k)
    x = torch.randn(m, shape.k, generator=gen, device=ctx.device).to(ctx.dtype)
    ref32 = reference32(x, weights[0])
    elt = x.element_size()
    cublas = Result("cublas", "ref")
    run_candidate(
        ctx, cublas, [lambda w=w: torch.nn.functional.linear(x, w) for w in weights], ref32, None
    )
    mantissa = {torch.bfloat16: 8, torch.float16: 11}[ctx.dtype]  # significant bits
    one_ulp = 2.0 ** (math.floor(math.log2(max(float(ref32.abs().max()), 1e-30))) + 1 - mantissa)
    tolerance = max(one_ulp, cublas.abs_err if cublas.abs_err is not None else 0.0)

    def fns_for(config: object | None) -> list:
        return [lambda w=w: tg.skinny_linear(x, w, config=config) for w in weights]

    current = Result(
        "current", "ref", None, tg.plan_skinny_linear(m, shape.n, shape.k, ctx.num_sms, None, elt)
    )
    run_candidate(ctx, current, fns_for(None), ref32, tolerance)
    by_plan: dict = {}
    skipped = 0

    def try_configs(configs: Sequence, stage: str) -> None:
        nonlocal skipped
        for config in configs:
            if time.perf_counter() > ctx.deadline:
                skipped += 1
                continue
            try:
                plan = tg.plan_skinny_linear(
                    m, shape.n, shape.k, ctx.num_sms, None, elt, config=config
                )
            except ValueError as exc:
                print(f"  invalid config {config}: {exc}")
                continue
            if plan in by_plan or (wasteful(plan) and plan != current.plan):
                continue
            result = by_plan[plan] = Result("candidate", stage, config, plan)
            ctx.compile_keys.add(compile_key(plan, m, shape.k))
            run_candidate(ctx, result, fns_for(config), ref32, tolerance)

    def fastest(count: int) -> list:
        timed = [r for r in by_plan.values() if r.ok and r.us is not None]
        return [r.config for r in sorted(timed, key=lambda r: r.us)[:count]]

    try_configs(block_configs(tg, m), "blocks")
    try_configs(split_configs(fastest(args.top)), "splits")
    try_configs(hint_configs(fastest(args.top)), "hints")
    confirm = [r for r in by_plan.values() if r.config in fastest(args.top)]
    confirm += [r for r in (current, cublas) if r.ok and r.us is not None]
    for _ in range(args.confirm_rounds):
        for result in confirm:
            try:
                fns = (
                    fns_for(result.config)
                    if result.label != "cublas"
                    else [lambda w=w: torch.nn.functional.linear(x, w) for w in weights]
                )
                result.confirm_us.append(ctx.timer(fns, args.confirm_replays))
            except Exception as exc:  # noqa: BLE001
                result.error = result.error or f"confirm: {type(exc).__name__}: {exc}"
    ours = [r for r in [current, *by_plan.values()] if r.ok and r.best_us is not None]
    best = min(ours, key=lambda r: (not r.confirm_us, r.best_us), default=None)
    return {
        "m": m,
        "shape": shape,
        "current": current,
        "cublas": cublas,
        "results": list(by_plan.values()),
        "best": best,
        "skipped": skipped,
        "bytes": shape.n * shape.k * elt,
    }


# --------------------------------------------------------------------------- report


def _us(us: float | None) -> str:
    return "-" if us is None else f"{us:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _gbps(nbytes: int, us: float | None) -> str:
    return f"{nbytes / us / 1e3:.0f}" if us else "-"


def shape_section(entry: dict, show: int) -> list[str]:
    shape, m, nbytes = entry["shape"], entry["m"], entry["bytes"]
    current, cublas = entry["current"], entry["cublas"]
    timed = sorted(
        (r for r in entry["results"] if r.ok and r.best_us is not None),
        key=lambda r: (not r.confirm_us, r.best_us),
    )
    failed = [r for r in entry["results"] if not r.ok]
    counts = {}
    for r in entry["results"]:
        counts[r.stage] = counts.get(r.stage, 0) + 1
    stages = ", ".join(f"{stage} {n}" for stage, n in counts.items())
    lines = [
        f"### {shape.label(m)} ({nbytes / 1e6:.1f} MB)",
        "",
        f"{len(entry['results'])} plans timed ({stages}), {len(failed)} failed, "
        f"{entry['skipped']} skipped (time limit); * = confirmed (median of rounds)",
        "",
        "| # | config | µs | GB/s | cuBLAS / this | current / this | check |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = [(str(i + 1), r) for i, r in enumerate(timed[:show])]
    rows += [("cur", current), ("ref", cublas)] + [("FAIL", r) for r in failed]
    for rank, r in rows:
        star = "*" if r.confirm_us else ""
        lines.append(
            f"| {rank} | {r.describe()} | {_us(r.best_us)}{star} | "
            f"{_gbps(nbytes, r.best_us)} | {_ratio(cublas.best_us, r.best_us)} | "
            f"{_ratio(current.best_us, r.best_us)} | {r.check_text()} |"
        )
    return lines + [""]


def best_table(entries: list[dict]) -> list[str]:
    lines = [
        "| shape | current µs | best µs | best GB/s | cuBLAS µs | best vs current | "
        "best vs cuBLAS | best config |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        best, current, cublas = e["best"], e["current"], e["cublas"]
        best_us = best.best_us if best else None
        lines.append(
            f"| {e['shape'].label(e['m'])} | {_us(current.best_us)} | {_us(best_us)} | "
            f"{_gbps(e['bytes'], best_us)} | {_us(cublas.best_us)} | "
            f"{_ratio(current.best_us, best_us)} | {_ratio(cublas.best_us, best_us)} | "
            f"{best.describe() if best else '-'} |"
        )
    return lines


def totals(entries: list[dict]) -> list[str]:
    """Per model and M: the four per-layer projections summed, and per token (layers x that
    + lm_head), current vs best vs cuBLAS."""
    lines = []
    groups: dict = {}
    for e in entries:
        groups.setdefault((e["shape"].model, e["m"]), []).append(e)
    for (model, m), group in groups.items():
        sums = {}
        for part in ("layer", "lm_head"):
            members = [e for e in group if (e["shape"].name == "lm_head") == (part == "lm_head")]
            for label, pick in (
                ("current", lambda e: e["current"]),
                ("best", lambda e: e["best"]),
                ("cublas", lambda e: e["cublas"]),
            ):
                values = [pick(e).best_us if pick(e) else None for e in members]
                if members and all(v is not None for v in values):
                    sums[(part, label)] = sum(values)
        layers = LAYERS.get(model)
        cells = []
        for label in ("current", "best", "cublas"):
            layer, head = sums.get(("layer", label)), sums.get(("lm_head", label))
            text = f"{label}: layer {_us(layer)} µs"
            if layers and layer is not None and head is not None:
                text += f", token {(layers * layer + head) / 1e3:.3f} ms"
            cells.append(text)
        lines.append(
            f"- {model} M={m} ({layers or '?'} layers, qkv+o_proj+gate_up+down; "
            f"token = layers x layer + lm_head): " + "; ".join(cells)
        )
    return lines


def tuned_literal(tg: types.ModuleType, entries: list[dict], num_sms: int, min_gain: float) -> str:
    """SKINNY_TUNED with an entry per measured shape whose best config beats the current plan
    by >= min_gain (pinned: clamped blocks, explicit split), existing entries kept otherwise."""
    table = dict(tg.SKINNY_TUNED)
    notes = {}
    # several M of one bucket: the bucket's largest M (its key's max_m) decides, else the last
    for e in sorted(entries, key=lambda e: e["m"] == bucket_max_m(tg, e["m"])):
        shape, m, best, current = e["shape"], e["m"], e["best"], e["current"]
        key = (num_sms, bucket_max_m(tg, m), shape.n, shape.k)
        if best is None or best.config is None or best.plan == current.plan:
            continue  # the current plan is (one of) the fastest: nothing to change
        if current.best_us is None:
            continue
        if best.best_us <= current.best_us * (1 - min_gain):
            table[key] = pinned(tg, best.config, best.plan, m, shape.n, shape.k, num_sms)
            notes[key] = (
                f"{shape.label(m)}: {current.best_us:.1f} -> "
                f"{best.best_us:.1f} µs (cuBLAS {_us(e['cublas'].best_us)})"
            )
    fields = ", ".join(f.name for f in dataclasses.fields(tg.SkinnyConfig))
    header = f"# (num_sms, max_m, N, K): SkinnyConfig({fields})"
    lines = textwrap.wrap(header, 99, subsequent_indent="#     ")
    lines.append("SKINNY_TUNED: dict[tuple[int, int, int, int], SkinnyConfig] = {")
    for key in sorted(table):
        lines.append(f"    # {notes.get(key, 'kept from the current table')}")
        lines.append(f"    {key!r}: {config_literal(table[key])},")
    lines.append("}")
    return "\n".join(lines)


def result_json(entry: dict, r: Result) -> dict:
    return {
        "model": entry["shape"].model,
        "shape": entry["shape"].name,
        "m": entry["m"],
        "n": entry["shape"].n,
        "k": entry["shape"].k,
        "label": r.label,
        "stage": r.stage,
        "plan": r.describe(),
        "config": dataclasses.asdict(r.config) if r.config else None,
        "us": r.us,
        "confirm_us": r.confirm_us,
        "first_call_s": r.first_call_s,
        "abs_err": r.abs_err,
        "ulp_err": r.ulp_err,
        "mismatch": r.mismatch,
        "ok": r.ok,
        "error": r.error,
        "best": r is entry["best"],
    }


def report(ctx: Context, entries: list[dict], title: str, started: float, final: bool) -> str:
    args = ctx.args
    lines = [
        f"# {title}",
        "",
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}, torch {torch.__version__}, triton "
        f"{_triton_version()}, {ctx.num_sms} SMs, {args.dtype}; "
        f"`python scripts/gpu/sweep_gemv.py {' '.join(sys.argv[1:])}`; "
        f"{time.perf_counter() - started:.0f} s, of which first calls (compiles) "
        f"{ctx.first_call_s:.0f} s; {len(ctx.compile_keys)} constexpr sets"
        + ("" if final else " (partial: still running)"),
        "",
    ]
    lines += ["## Best config per shape", ""] + best_table(entries) + [""] + totals(entries)
    lines += ["", "## Per shape", ""]
    for entry in entries:
        lines += shape_section(entry, args.show)
    lines += [
        "## SKINNY_TUNED (paste into pagedserve/kernels/triton_gemv.py)",
        "",
        "```python",
        tuned_literal(ctx.tg, entries, ctx.num_sms, args.min_gain),
        "```",
        "",
    ]
    return "\n".join(lines)


def _triton_version() -> str:
    triton = sys.modules.get("triton")
    return getattr(triton, "__version__", "?")


def write_outputs(
    ctx: Context, entries: list[dict], title: str, started: float, final: bool
) -> str:
    text = report(ctx, entries, title, started, final)
    if ctx.args.out is not None:
        ctx.args.out.parent.mkdir(parents=True, exist_ok=True)
        ctx.args.out.write_text(text)
        rows = [
            result_json(e, r) for e in entries for r in [e["current"], e["cublas"], *e["results"]]
        ]
        ctx.args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    return text


# --------------------------------------------------------------------------- driver


def all_shapes(args: argparse.Namespace) -> list[Shape]:
    if args.dry_run:
        return [Shape(*s) for s in DRY_SHAPES]
    shapes = []
    for model in sorted(SWEEP_MODELS, key=lambda m: m.name != "llama-3.1-8b"):
        if model.name in args.models:
            for name, n, k in bench_kernels.projection_shapes(model):
                if not args.shapes or name in args.shapes:
                    shapes.append(Shape(model.name, name, n, k))
    return shapes


def plan_summary(tg: types.ModuleType, args: argparse.Namespace) -> list[str]:
    """The real shapes on an H200 (132 SMs): stage-1 plans and constexpr sets (one Triton
    compile each), and the most stages 2-3 can add."""
    lines = []
    keys: set = set()
    plans_total = 0
    real = argparse.Namespace(**{**vars(args), "dry_run": False})
    for m in args.m:
        for shape in all_shapes(real):
            plans = {}
            for config in block_configs(tg, m):
                plan = tg.plan_skinny_linear(m, shape.n, shape.k, H200_SMS, config=config)
                if plan not in plans and not wasteful(plan):
                    plans[plan] = config
                    keys.add(compile_key(plan, m, shape.k))
            plans_total += len(plans)
            default = tg.plan_skinny_linear(m, shape.n, shape.k, H200_SMS)
            lines.append(
                f"  {shape.label(m)}: {len(plans)} block plans; current {default.describe()}"
            )
    later = len(args.m) * len(all_shapes(real)) * args.top * (len(SPLITS) + len(LOAD_HINTS))
    lines.append(
        f"stage 1: {plans_total} plans, {len(keys)} constexpr sets (compiles); stages "
        f"2-3 add at most {later} plans (most collapse: splits clamp to the K chunks) "
        f"and a few dozen compiles (hints; split / unsplit variants)"
    )
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the report here (and FILE.json)")
    parser.add_argument("--m", type=int, nargs="+", default=[1], help="batch rows (1..16)")
    parser.add_argument(
        "--models",
        nargs="+",
        default=[m.name for m in bench_kernels.MODELS],
        choices=[m.name for m in SWEEP_MODELS],
    )
    parser.add_argument(
        "--shapes", nargs="+", choices=["qkv", "o_proj", "gate_up", "down", "lm_head"]
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--calls", type=int, default=20, help="calls in one CUDA graph (min)")
    parser.add_argument("--replays", type=int, default=5, help="timed replays, screening")
    parser.add_argument("--confirm-rounds", type=int, default=3)
    parser.add_argument("--confirm-replays", type=int, default=10)
    parser.add_argument("--top", type=int, default=3, help="configs carried to the next stage")
    parser.add_argument("--show", type=int, default=6, help="configs listed per shape")
    parser.add_argument(
        "--l2-multiple",
        type=float,
        default=4.0,
        help="weight copies hold at least this many L2 sizes",
    )
    parser.add_argument(
        "--min-gain",
        type=float,
        default=0.02,
        help="SKINNY_TUNED entry only if this much faster than current",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=300.0,
        help="seconds; then untried candidates are skipped (reported)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU: the grid on the real shapes, then tiny shapes through the "
        "Triton interpreter (checks, stages, report; wall-clock times)",
    )
    args = parser.parse_args(argv)
    if not all(1 <= m <= 16 for m in args.m):
        parser.error("--m must be in 1..16")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run on a CPU machine")
        return 2
    tg = load_gemv(args.dry_run)
    if args.dry_run:
        print("Grid on the real shapes (H200 plans, nothing launched):")
        print("\n".join(plan_summary(tg, args)))
        device, num_sms, timer = torch.device("cpu"), tg._num_sms(torch.device("cpu")), WallTimer()
        title = "skinny_linear sweep: DRY RUN (CPU interpreter, tiny shapes, wall-clock times)"
        args.confirm_rounds = min(args.confirm_rounds, 1)
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference: IEEE
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        timer = GraphTimer(args.calls, args.replays)
        tg._counters(device)  # the split-K counters exist before any capture
        title = f"skinny_linear sweep on {torch.cuda.get_device_name(device)}"
    ctx = Context(
        tg,
        device,
        getattr(torch, args.dtype),
        num_sms,
        timer,
        args,
        deadline=started + args.time_limit,
    )
    entries = []
    for m in args.m:
        for shape in all_shapes(args):
            shape_start = time.perf_counter()
            entry = sweep_shape(ctx, m, shape)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the shape's weight copies
            entries.append(entry)
            best = entry["best"]
            print(
                f"{shape.label(m)}: best {_us(best.best_us if best else None)} µs "
                f"({best.describe() if best else '-'}), current "
                f"{_us(entry['current'].best_us)} µs, cuBLAS {_us(entry['cublas'].best_us)} µs"
                f"; {len(entry['results'])} plans in {time.perf_counter() - shape_start:.1f} s"
            )
            write_outputs(ctx, entries, title, started, final=False)
    text = write_outputs(ctx, entries, title, started, final=True)
    print()
    print(text)
    if args.out is not None:
        print(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    failures = [(e, r) for e in entries for r in [e["current"], *e["results"]] if not r.ok]
    for e, r in failures:
        print(f"FAILED: {e['shape'].label(e['m'])}: {r.describe()}: {r.check_text()}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
