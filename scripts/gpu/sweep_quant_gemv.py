"""Sweep the quantized decode GEMVs (pagedserve.kernels.triton_quant) on one GPU: for each scheme
(fp8 W8A16, int8 g128, int4 g128) and Llama-3.1-8B projection (qkv 6144x4096, o_proj 4096x4096,
gate_up 28672x4096, down 4096x14336) at batch 1, 4 and 16, check every launch variant against
the dequantized fp32 reference, time it, and print the best config per shape and scheme with a
QUANT_GEMV_TUNED literal to paste into triton_quant.py.

    python3 scripts/gpu/sweep_quant_gemv.py --out "$OUT/quant_sweep.md"    # H200: ~2-3 min
    python3 scripts/gpu/sweep_quant_gemv.py --dry-run                      # CPU interpreter
    python3 scripts/gpu/sweep_quant_gemv.py --batches 1 --schemes int4 int8 --convert half \
        --out "$OUT/quant_half.md"    # the "half" variants against current only: < 60 s
    python3 scripts/compile_quant_gemv.py    # no GPU: every variant compiled for sm_90

Phases:
  1. compile: every (scheme, shape, batch, variant) launch compiled in parallel worker
     processes (Triton's `warmup`: compiled into its on-disk cache, nothing launched), so the
     timing phase finds every kernel built (one compile per constexpr set serves every shape;
     what a worker failed to build is tried again there, and its error reported);
  2. per (batch, scheme, shape): each variant's first result against F.linear(x, W_deq) in
     fp32 (max abs error; it fails above one bf16 ulp of the largest output, 2^-8 max|y|, and
     is then never picked), then timed with triton.testing.do_bench (median; warm, no CUDA
     graph; the L2 is flushed before every call, so the weight streams from HBM). Next to
     them: fp8 W8A8 (per-token activation quantization + torch._scaled_mm), the bf16 Triton
     GEMV (triton_gemv.skinny_linear) and bf16 cuBLAS on the same shape;
  3. report: per case every variant (µs, GB/s of weight bytes: 1 byte a weight for fp8 / int8,
     0.5 for int4, plus the int schemes' bf16 scales and zeros), the best per shape and scheme,
     the 32-layer sum at batch 1 (the weight GEMVs of a Llama-3.1-8B decode step without the
     LM head), and the literal. --time-limit bounds phase 2 (cases left are reported skipped).
The report is rewritten to --out after every case (a crash keeps what was measured).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import functools
import multiprocessing
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

SHAPES = (("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336))  # fmt: skip
DRY_SHAPES = (("tiny_a", 48, 384), ("tiny_b", 40, 256))
BATCHES = (1, 4, 16)
SCHEMES = ("fp8", "int8", "int4")
GROUP = 128
LAYERS = 32
MAX_ERROR = 2.0**-8  # of max |y|: one bf16 ulp of the largest output
SLEEP_CYCLES = 20_000_000  # ~10 ms spin ahead of each timed burst (see timer)
BURST_CALLS = 24
ROUNDS = 5
COPIES_BYTES = 160_000_000  # > 3x the H200's L2

# Variants: (use_dot, block_n, block_k, num_warps, unroll, num_stages, split_k, convert, unpack,
# w_evict, accumulate, fold) as QuantGemvConfig fields; per scheme and batch bucket.
F, T = False, True
IL, PL, EF = "interleave", "planes", "evict_first"
FP8_VARIANTS = {
    1: [(F, 4, 2048, 4, 1, 1, None, "cvt"), (F, 4, 2048, 4, 1, 1, None, "bits"),
        (F, 2, 2048, 4, 1, 1, None, "cvt"), (F, 2, 2048, 4, 1, 1, None, "bits"),
        (F, 2, 2048, 4, 2, 1, None, "cvt"), (F, 1, 4096, 8, 1, 1, None, "cvt"),
        (F, 4, 1024, 2, 1, 1, None, "cvt"), (F, 8, 512, 1, 1, 1, None, "cvt"),
        (F, 2, 1024, 2, 2, 1, None, "cvt"), (F, 4, 2048, 4, 1, 1, 2, "cvt"),
        (F, 4, 2048, 4, 1, 1, None, "cvt", "interleave", ""),
        (F, 4, 2048, 4, 2, 1, None, "cvt"), (F, 2, 4096, 8, 1, 1, None, "cvt"),
        (F, 4, 2048, 4, 1, 1, 4, "cvt"), (T, 16, 256, 4, 1, 3), (T, 32, 128, 4, 1, 4),
        (F, 4, 2048, 4, 1, 1, None, "cvt", IL, EF, "chunk", 16),
        (F, 8, 2048, 4, 1, 1, None, "cvt", IL, EF, "chunk", 16),
        (F, 4, 2048, 4, 2, 1, None, "cvt", IL, EF, "chunk", 16),
        (F, 4, 1024, 2, 1, 1, None, "cvt", IL, EF, "chunk", 16),
        (F, 8, 1024, 2, 2, 1, None, "cvt", IL, EF, "chunk", 16),
        (F, 2, 4096, 8, 1, 1, None, "cvt", IL, EF, "chunk", 16),
        (F, 4, 2048, 4, 1, 1, None, "cvt", IL, EF, "chunk", 4),
        (T, 64, 128, 4, 1, 3)],
    4: [(F, 1, 2048, 4, 1, 1, None, "cvt"), (F, 1, 2048, 4, 1, 1, None, "bits"),
        (F, 2, 2048, 4, 1, 1, None, "cvt", IL, EF, "chunk", 16),
        (F, 4, 1024, 2, 1, 1, None, "cvt", IL, EF, "chunk", 16),
        (F, 2, 1024, 4, 1, 1, None, "cvt"), (F, 1, 1024, 2, 2, 1, None, "cvt"),
        (T, 16, 256, 4, 1, 3), (T, 32, 128, 4, 1, 4), (T, 16, 128, 4, 1, 4),
        (T, 64, 128, 4, 1, 3), (T, 16, 512, 4, 1, 3)],
    16: [(T, 32, 128, 4, 1, 4), (T, 16, 128, 4, 1, 4), (T, 16, 256, 4, 1, 3),
         (T, 64, 128, 4, 1, 3), (T, 32, 256, 4, 1, 3), (T, 16, 512, 8, 1, 3)],
}  # fmt: skip
INT_VARIANTS = {
    1: [(F, 32, 128, 4, 2, 1, None, "bits"), (F, 32, 128, 4, 2, 1, None, "cvt"),
        (F, 64, 128, 4, 2, 1, None, "bits"), (F, 64, 128, 4, 2, 1, None, "bits", "reshape"),
        (F, 64, 128, 4, 2, 1, None, "cvt"), (F, 128, 128, 4, 2, 1, None, "bits"),
        (F, 128, 128, 4, 2, 1, None, "bits", "reshape"), (F, 32, 128, 4, 4, 1, None, "bits"),
        (F, 64, 128, 4, 4, 1, None, "bits"), (F, 16, 128, 2, 4, 1, None, "bits"),
        (F, 128, 128, 8, 2, 1, None, "bits"), (F, 256, 128, 8, 1, 1, None, "bits"),
        (F, 32, 64, 2, 4, 1, None, "bits"), (F, 64, 128, 4, 2, 1, None, "bits", "interleave", ""),
        (F, 64, 128, 4, 2, 1, 8, "bits"), (F, 64, 128, 4, 2, 1, 16, "bits"),
        (F, 128, 128, 4, 4, 1, None, "bits"), (F, 32, 128, 1, 2, 1, None, "bits"),
        (T, 16, 128, 4, 1, 3, None, "bits"), (T, 16, 128, 4, 1, 3, None, "cvt"),
        (T, 32, 128, 4, 1, 4, None, "bits"), (T, 64, 128, 4, 1, 3, None, "bits"),
        (T, 16, 128, 4, 1, 3, None, "bits", "reshape"),
        (F, 32, 128, 4, 2, 1, None, "bits", IL, EF, "tile"),
        (F, 16, 128, 4, 2, 1, None, "bits", IL, EF, "tile"),
        (F, 64, 128, 4, 1, 1, None, "bits", IL, EF, "tile"),
        (F, 32, 128, 4, 4, 1, None, "bits", IL, EF, "tile"),
        (F, 16, 128, 2, 2, 1, None, "bits", IL, EF, "tile"),
        (F, 32, 128, 4, 2, 1, None, "cvt", IL, EF, "tile"),
        (F, 32, 128, 4, 2, 1, None, "bits", "reshape", EF, "tile"),
        (F, 32, 128, 4, 2, 1, 8, "bits", IL, EF, "tile"),
        (T, 64, 128, 4, 1, 4, None, "bits"), (T, 128, 128, 8, 1, 3, None, "bits"),
        (T, 64, 128, 8, 1, 3, None, "bits"), (T, 64, 64, 4, 1, 4, None, "bits"),
        (T, 64, 128, 4, 1, 3, 4, "bits"),
        (F, 64, 128, 4, 2, 1, None, "bits", PL), (F, 32, 128, 4, 2, 1, None, "bits", PL),
        (F, 128, 128, 4, 2, 1, None, "bits", PL), (F, 64, 128, 4, 4, 1, None, "bits", PL),
        (F, 64, 128, 8, 2, 1, None, "bits", PL), (F, 32, 128, 2, 2, 1, None, "bits", PL),
        (F, 32, 128, 4, 2, 1, None, "bits", PL, EF, "tile"),
        (F, 64, 128, 4, 1, 1, None, "bits", PL, EF, "tile"),
        (F, 16, 128, 2, 2, 1, None, "bits", PL, EF, "tile"),
        (F, 32, 128, 4, 4, 1, None, "bits", PL, EF, "tile"),
        (F, 32, 128, 4, 2, 1, 8, "bits", PL, EF, "tile"),
        (F, 64, 128, 4, 2, 1, 8, "bits", PL), (T, 64, 128, 4, 1, 3, None, "bits", PL),
        (T, 32, 128, 4, 1, 4, None, "bits", PL), (T, 128, 128, 8, 1, 3, None, "bits", PL),
        (F, 32, 128, 4, 2, 1, None, "half", PL, EF, "tile"),
        (F, 32, 128, 4, 4, 1, None, "half", PL, EF, "tile"),
        (F, 64, 128, 4, 2, 1, None, "half", PL, EF, "tile"),
        (F, 16, 128, 2, 2, 1, None, "half", PL, EF, "tile"),
        (F, 16, 128, 4, 2, 1, None, "half", PL, EF, "tile"),
        (F, 32, 128, 4, 2, 1, None, "half", PL), (F, 64, 128, 4, 2, 1, None, "half", PL),
        (F, 32, 128, 4, 2, 1, None, "half", IL, EF, "tile"),
        (F, 32, 128, 4, 2, 1, None, "half"), (F, 32, 128, 1, 2, 1, None, "half")],
    4: [(F, 16, 128, 4, 2, 1, None, "bits"), (F, 16, 128, 4, 2, 1, None, "bits", "reshape"),
        (F, 8, 128, 2, 2, 1, None, "bits"), (F, 32, 128, 4, 2, 1, None, "bits"),
        (T, 16, 128, 4, 1, 3, None, "bits"), (T, 16, 128, 4, 1, 3, None, "cvt"),
        (T, 32, 128, 4, 1, 4, None, "bits"), (T, 64, 128, 4, 1, 3, None, "bits"),
        (T, 16, 128, 4, 1, 3, None, "bits", "reshape"),
        (F, 8, 128, 4, 2, 1, None, "bits", IL, EF, "tile"),
        (F, 16, 128, 4, 1, 1, None, "bits", IL, EF, "tile"),
        (T, 128, 128, 8, 1, 3, None, "bits"), (T, 64, 128, 4, 1, 4, None, "bits"),
        (F, 16, 128, 4, 2, 1, None, "bits", PL), (F, 32, 128, 4, 2, 1, None, "bits", PL),
        (F, 8, 128, 4, 2, 1, None, "bits", PL, EF, "tile"),
        (F, 16, 128, 4, 1, 1, None, "bits", PL, EF, "tile"),
        (T, 64, 128, 4, 1, 3, None, "bits", PL), (T, 32, 128, 4, 1, 4, None, "bits", PL),
        (F, 8, 128, 4, 2, 1, None, "half", PL, EF, "tile"),
        (F, 16, 128, 4, 1, 1, None, "half", PL, EF, "tile"),
        (F, 16, 128, 4, 2, 1, None, "half", PL), (F, 16, 128, 4, 2, 1, None, "half")],
    16: [(T, 32, 128, 4, 1, 4, None, "bits"), (T, 32, 128, 4, 1, 4, None, "cvt"),
         (T, 16, 128, 4, 1, 3, None, "bits"), (T, 64, 128, 4, 1, 3, None, "bits"),
         (T, 16, 128, 2, 1, 4, None, "bits"), (T, 128, 128, 8, 1, 3, None, "bits"),
         (T, 32, 128, 4, 1, 4, None, "bits", "reshape"), (T, 64, 128, 4, 1, 3, None, "bits", PL),
         (T, 32, 128, 4, 1, 4, None, "bits", PL), (T, 128, 128, 8, 1, 3, None, "bits", PL)],
}  # fmt: skip
FIELDS = ("use_dot", "block_n", "block_k", "num_warps", "unroll", "num_stages", "split_k",
          "convert", "unpack", "w_evict", "accumulate", "fold")  # fmt: skip


@dataclass(frozen=True)
class Pick:
    """Which variants a case times: the first `limit` (None: all) of those whose convert is in
    `converts` (None: any); "current" and the baselines always."""

    limit: int | None = None
    converts: tuple[str, ...] | None = None


def variants(tq: types.ModuleType, scheme: str, m: int, pick: Pick) -> list[tuple]:
    """(config or None for "current", group-major scales) pairs to time for an M-row product:
    "current", the picked variant configs, and for the integer schemes the first fma and the
    first dot config again with group-major scales and zeros."""
    configs = [c for c in variant_configs(tq, scheme, m)
               if pick.converts is None or c.convert in pick.converts][: pick.limit]  # fmt: skip
    pairs: list[tuple] = [(None, False), *((c, False) for c in configs)]
    if scheme != "fp8":
        for use_dot in (False, True):
            pairs += [(c, True) for c in configs if c.use_dot == use_dot][:1]
    return pairs


def variant_configs(tq: types.ModuleType, scheme: str, m: int) -> list:
    """The QuantGemvConfigs to time for an M-row product (int8 has no int4 unpack choice:
    its "reshape" variants are dropped)."""
    table = FP8_VARIANTS if scheme == "fp8" else INT_VARIANTS
    configs = []
    for row in table[tq.m_bucket(scheme, m)]:
        config = tq.QuantGemvConfig(**dict(zip(FIELDS, row)))
        if scheme != "int4" and config.unpack != "interleave":
            continue
        configs.append(config)
    return configs


def kernels() -> types.ModuleType:
    import bench_kernels

    bench_kernels.import_package()
    from pagedserve.kernels import triton_quant

    return triton_quant


# --------------------------------------------------------------------------- operands


@dataclass
class Operands:
    """One weight in a scheme's form (and copies of it: see copies_for), its fp32 dequantized
    copy and its bytes."""

    scheme: str
    run: Callable  # (x, config, group_major, copy) -> y
    copies: int
    dense: object  # torch.Tensor [N, K] fp32 (None when compiling only)
    nbytes: int
    tensors: list = dataclasses.field(default_factory=list)  # fp8: (wq, w_scale) a copy

    def calls(self, x: object, config: object, group_major: bool) -> list[Callable]:
        """One call per copy."""
        return [functools.partial(self.run, x, config, group_major, i) for i in range(self.copies)]


def make_operands(tq: types.ModuleType, scheme: str, n: int, k: int, device: str,
                  fill: bool) -> Operands:  # fmt: skip
    """Random codes (asymmetric, bf16 scales ~1e-3 and integer zeros) or fp8-quantized
    N(0, 0.02) weights; fill False: uninitialised and one copy (compiling only)."""
    import torch

    from pagedserve.kernels import quant_ref

    gen = torch.Generator(device=device).manual_seed(n * 7 + k)
    if scheme == "fp8":
        if fill:
            w = torch.randn(n, k, device=device, generator=gen) * 0.02
            wq, w_scale = quant_ref.quantize_fp8_rows(w)
            del w
            wq, w_scale = wq.contiguous(), w_scale.squeeze(1).contiguous()
            dense = wq.float() * w_scale[:, None]
        else:
            wq = torch.empty(n, k, dtype=quant_ref.FP8_DTYPE, device=device)
            w_scale, dense = torch.ones(n, device=device), None
        nbytes = n * k + 4 * n
        copies = copies_for(nbytes) if fill else 1
        tensors = [(wq, w_scale), *((wq.clone(), w_scale.clone()) for _ in range(copies - 1))]

        def run_fp8(x: torch.Tensor, config: object, _gm: bool, i: int) -> torch.Tensor:
            return tq.fp8_weight_gemv(x, *tensors[i], config=config)

        return Operands(scheme, run_fp8, copies, dense, nbytes, tensors)
    bits = 4 if scheme == "int4" else 8
    groups = k // GROUP
    if fill:
        codes = torch.randint(0, 2**bits, (n, k), device=device, generator=gen, dtype=torch.int32)
        qweight = quant_ref.pack_codes(codes, bits)
        del codes
    else:
        shape, dtype = ((n, k // 8), torch.int32) if bits == 4 else ((n, k), torch.uint8)
        qweight = torch.empty(shape, dtype=dtype, device=device)
    scales = (torch.rand(n, groups, device=device, generator=gen) * 2e-3 + 5e-4).bfloat16()
    zeros = torch.randint(0, 2**bits, (n, groups), device=device, generator=gen).bfloat16()
    first = quant_ref.IntWeight(qweight, scales, zeros, bits, GROUP)
    dense = quant_ref.dequantize_int_weight(first, torch.float32) if fill else None
    nbytes = n * k * bits // 8 + 4 * n * groups
    copies = copies_for(nbytes) if fill else 1
    weights = [first, *(quant_ref.IntWeight(qweight.clone(), scales.clone(), zeros.clone(), bits,
                                            GROUP) for _ in range(copies - 1))]  # fmt: skip
    # the same values with group-major strides (one group's scales contiguous over N)
    group_major = [quant_ref.IntWeight(w.qweight, w.scales.t().contiguous().t(),
                                       w.zeros.t().contiguous().t(), bits, GROUP)
                   for w in weights]  # fmt: skip

    def run(x: torch.Tensor, config: object, gm: bool, i: int) -> torch.Tensor:
        return tq.int_weight_gemv(x, (group_major if gm else weights)[i], config=config)

    return Operands(scheme, run, copies, dense, nbytes)


# --------------------------------------------------------------------------- phase 1: compile


class _CompileOnly:
    """Stands in for a @triton.jit kernel: kernel[grid](...) compiles (warmup), launches
    nothing."""

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: tuple) -> Callable:
        return lambda *args, **kwargs: self.kernel.warmup(*args, grid=grid, **kwargs)


_WORKER: dict[str, object] = {}


def compile_task(task: tuple) -> tuple[tuple, float, str]:
    """Worker: compile one task_of() launch; (task, seconds, error)."""
    scheme, _name, n, k, m, frozen, group_major = task
    start = time.perf_counter()
    try:
        import torch

        tq = _WORKER.get("tq")
        if tq is None:
            tq = _WORKER["tq"] = kernels()
            tq._quant_gemv_kernel = _CompileOnly(tq._quant_gemv_kernel)
        key = (scheme, n, k)
        if _WORKER.get("key") != key:  # one weight at a time per worker
            _WORKER["ops"] = make_operands(tq, scheme, n, k, "cuda", fill=False)
            _WORKER["key"] = key
        x = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
        config = None if frozen is None else tq.QuantGemvConfig(**dict(frozen))
        _WORKER["ops"].run(x, config, group_major, 0)
        return task, time.perf_counter() - start, ""
    except Exception as exc:  # reported; the timing phase skips the variant
        return task, time.perf_counter() - start, f"{type(exc).__name__}: {exc}"[:300]


def compile_all(tasks: list[tuple], workers: int) -> dict[tuple, str]:
    """Compile every task in `workers` processes; task -> error ("" when built). Should the
    pool break (a worker dying), the tasks left compile on first use in the timing phase."""
    errors: dict[tuple, str] = {}
    context = multiprocessing.get_context("spawn")
    chunk = max(1, len(tasks) // (4 * workers))
    try:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            for task, _seconds, error in pool.map(compile_task, tasks, chunksize=chunk):
                errors[task] = error
    except Exception as exc:  # BrokenProcessPool and the like
        print(f"compile pool failed after {len(errors)} tasks ({exc!r}); the rest compile "
              "in the timing phase", flush=True)  # fmt: skip
    return errors


# --------------------------------------------------------------------------- phase 2: time


@dataclass
class Result:
    """One implementation on one (scheme, shape, m): a QuantGemvConfig, "current" (what the
    engine launches today: config None) or a baseline ("W8A8 _scaled_mm", "bf16 ...")."""

    label: str
    config: object | None
    group_major: bool = False  # int schemes: scales / zeros with group-major strides
    programs: int = 0
    us: float | None = None
    abs_err: float | None = None
    ok: bool = True
    error: str = ""


@dataclass
class Case:
    scheme: str
    name: str
    n: int
    k: int
    m: int
    nbytes: int
    results: list[Result] = dataclasses.field(default_factory=list)

    @property
    def title(self) -> str:
        return f"{self.scheme} {self.name} {self.n}x{self.k} M={self.m}"

    def best(self, quant_only: bool = True) -> Result | None:
        quant = [
            r
            for r in self.results
            if r.config is not None or r.label.startswith("current") or not quant_only
        ]
        timed = [r for r in quant if r.ok and r.us is not None]
        return min(timed, key=lambda r: r.us) if timed else None

    def find(self, label: str) -> Result | None:
        return next((r for r in self.results if r.label == label), None)


def timer(device: str) -> Callable[[list[Callable]], float]:
    """µs of one call given one callable per weight copy: on a GPU the median over ROUNDS
    bursts of BURST_CALLS back-to-back calls (cycling through the copies), each burst queued
    behind a SLEEP_CYCLES spin kernel so that the CPU has enqueued all of it before the GPU
    starts: CUDA events around the burst time the kernels, not the Python launch overhead
    (which exceeds these kernels: do_bench's per-call timing measured the launchers); one
    timed call on the CPU (dry run)."""
    if device == "cpu":

        def once(fns: list[Callable]) -> float:
            start = time.perf_counter()
            fns[0]()
            return (time.perf_counter() - start) * 1e6

        return once
    import torch

    def burst(fns: list[Callable]) -> float:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(ROUNDS):
            torch.cuda._sleep(SLEEP_CYCLES)
            start.record()
            for i in range(BURST_CALLS):
                fns[i % len(fns)]()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / BURST_CALLS)
        return statistics.median(samples)

    return burst


def measure(result: Result, fns: list[Callable], reference: object, time_us: Callable) -> None:
    """Check fns[0]() against the fp32 reference (max abs error <= MAX_ERROR max|ref|), then
    time the calls (one per weight copy); an exception or a failed check is recorded, never
    raised."""
    try:
        got = fns[0]()
        result.abs_err = float((got.float() - reference).abs().max())
        limit = MAX_ERROR * float(reference.abs().max())
        result.ok = result.abs_err <= limit and bool(got.isfinite().all())
        if not result.ok:
            result.error = f"error {result.abs_err:.2e} > {limit:.2e}"
            return
        result.us = time_us(fns)
    except Exception as exc:
        result.ok, result.error = False, f"{type(exc).__name__}: {exc}"[:200]


def baselines(case: Case, x: object, w_bf16: object, ops: Operands,
              time_us: Callable) -> list[Result]:  # fmt: skip
    """bf16 Triton GEMV and cuBLAS on the bf16 weight; for fp8 also W8A8 (per-token fp8
    activations + torch._scaled_mm, the fp8 method's large-batch path) against its own
    reference (quant_ref.fp8_linear: the activation quantization included)."""
    import torch
    import torch.nn.functional as F

    from pagedserve.kernels import quant_ref, triton_gemv, triton_quant

    out = []
    reference = F.linear(x.float(), w_bf16.float())
    weights = [w_bf16, *(w_bf16.clone() for _ in range(copies_for(w_bf16.numel() * 2) - 1))]
    skinny = [functools.partial(triton_gemv.skinny_linear, x, w) for w in weights]
    cublas = [functools.partial(F.linear, x, w) for w in weights]
    for label, fns in (("bf16 Triton GEMV", skinny), ("bf16 cuBLAS", cublas)):
        out.append(Result(label, None))
        measure(out[-1], fns, reference, time_us)
    if case.scheme == "fp8" and x.device.type == "cuda":

        def scaled_mm(wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
            xq, x_scale = triton_quant.quantize_fp8_rows(x)
            return torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1),
                                    out_dtype=x.dtype)  # fmt: skip

        out.append(Result("W8A8 _scaled_mm", None))
        wq, w_scale = ops.tensors[0]
        w8a8_reference = quant_ref.fp8_linear(x.float(), wq, w_scale, None)
        fns = [functools.partial(scaled_mm, *tensors) for tensors in ops.tensors]
        measure(out[-1], fns, w8a8_reference, time_us)
    return out


def copies_for(nbytes: int) -> int:
    """Weight copies holding at least COPIES_BYTES in all (calls cycle through them, so each
    streams its weight from HBM, not from the 50 MB L2), at most 16."""
    return max(1, min(16, -(-COPIES_BYTES // nbytes)))


def task_of(case: Case, config: object | None, group_major: bool) -> tuple:
    """(scheme, name, n, k, m, the config's fields as sorted pairs or None, group_major):
    hashable and picklable (the compile workers rebuild the config)."""
    frozen = None if config is None else tuple(sorted(dataclasses.asdict(config).items()))
    return (case.scheme, case.name, case.n, case.k, case.m, frozen, group_major)


def run_case(tq: types.ModuleType, case: Case, ops: Operands, x: object, w_bf16: object,
             compile_errors: dict[tuple, str], time_us: Callable, num_sms: int,
             pick: Pick) -> None:  # fmt: skip
    """Every variant of the case (and "current", and the baselines) checked and timed."""
    reference = x.float() @ ops.dense.t()
    group = case.k if case.scheme == "fp8" else GROUP
    for config, group_major in variants(tq, case.scheme, case.m, pick):
        plan = tq.plan_quant_gemv(case.scheme, case.m, case.n, case.k, group, num_sms, config)
        label = plan.config.describe() if config else "current: " + plan.config.describe()
        result = Result(label + (" + group-major scales" if group_major else ""), config)
        result.group_major, result.programs = group_major, plan.programs
        case.results.append(result)
        measure(result, ops.calls(x, config, group_major), reference, time_us)
        error = compile_errors.get(task_of(case, config, group_major))
        if not result.ok and error:
            result.error += f" (compile worker: {error})"
    case.results += baselines(case, x, w_bf16, ops, time_us)


# --------------------------------------------------------------------------- report


def gbps(case: Case, us: float | None) -> str:
    return "-" if us is None else f"{case.nbytes / us / 1e3:,.0f}"


def fmt_us(result: Result | None) -> str:
    return "-" if result is None or result.us is None else f"{result.us:.1f}"


def case_table(case: Case) -> list[str]:
    lines = [f"### {case.title} ({case.nbytes / 1e6:.1f} MB of weights)\n",
             "| implementation | programs | µs | weight GB/s | max abs err | note |",
             "|---|---:|---:|---:|---:|---|"]  # fmt: skip
    ordered = sorted(case.results, key=lambda r: (r.us is None, r.us or 0.0))
    for r in ordered:
        err = "-" if r.abs_err is None else f"{r.abs_err:.2e}"
        lines.append(f"| {r.label} | {r.programs or '-'} | {fmt_us(r)} | {gbps(case, r.us)} | "
                     f"{err} | {r.error} |")  # fmt: skip
    return [*lines, ""]


def summary(cases: list[Case]) -> list[str]:
    lines = ["## Best config per shape and scheme\n",
             "| case | best µs | best GB/s | current µs | bf16 Triton µs | bf16 cuBLAS µs | "
             "W8A8 µs | max abs err | best config |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for case in cases:
        best = case.best()
        current = next((r for r in case.results if r.label.startswith("current")), None)
        err = "-" if best is None or best.abs_err is None else f"{best.abs_err:.2e}"
        lines.append(
            f"| {case.title} | {fmt_us(best)} | {gbps(case, best and best.us)} | "
            f"{fmt_us(current)} | {fmt_us(case.find('bf16 Triton GEMV'))} | "
            f"{fmt_us(case.find('bf16 cuBLAS'))} | {fmt_us(case.find('W8A8 _scaled_mm'))} | "
            f"{err} | {best.label if best else '-'} |"
        )
    return [*lines, "", *token_sums(cases), ""]


def token_sums(cases: list[Case]) -> list[str]:
    """Per scheme at M = 1: LAYERS x the sum over the four projections (no LM head)."""
    lines = [f"Batch 1, {LAYERS} layers x (qkv + o_proj + gate_up + down), LM head excluded:\n"]
    for scheme in SCHEMES:
        ones = [c for c in cases if c.scheme == scheme and c.m == 1]
        if len(ones) < len(SHAPES):
            continue
        sums = {}
        for label, pick in (("best", lambda c: c.best()),
                            ("current", lambda c: next((r for r in c.results
                                                        if r.label.startswith("current")), None)),
                            ("bf16 Triton", lambda c: c.find("bf16 Triton GEMV"))):  # fmt: skip
            picked = [pick(c) for c in ones]
            if all(r is not None and r.us is not None for r in picked):
                sums[label] = LAYERS * sum(r.us for r in picked) / 1e3
        lines.append(f"- {scheme}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in sums.items()))
    return lines


def tuned_literal(cases: list[Case], num_sms: int) -> list[str]:
    lines = [
        "## QUANT_GEMV_TUNED (paste into pagedserve/kernels/triton_quant.py)\n",
        "```python",
        "QUANT_GEMV_TUNED: dict[tuple[int, str, int, int, int], QuantGemvConfig] = {",
    ]
    for case in cases:
        best = case.best()
        if best is None or best.config is None:
            continue
        current = next((r for r in case.results if r.label.startswith("current")), None)
        layout = " (needs group-major scales / zeros)" if best.group_major else ""
        lines.append(f"    # {case.title}: {fmt_us(current)} -> {fmt_us(best)} µs{layout}")
        lines.append(f'    ({num_sms}, "{case.scheme}", {case.m}, {case.n}, {case.k}): '
                     f"{config_literal(best.config)},")  # fmt: skip
    return [*lines, "}", "```", ""]


def config_literal(config: object) -> str:
    """QuantGemvConfig(use_dot, block_n, block_k, num_warps, the fields off their defaults)."""
    fields = dataclasses.fields(config)
    head = [repr(getattr(config, f.name)) for f in fields[:4]]
    rest = [f"{f.name}={getattr(config, f.name)!r}".replace("'", '"') for f in fields[4:]
            if getattr(config, f.name) != f.default]  # fmt: skip
    return f"QuantGemvConfig({', '.join(head + rest)})"


def write_report(path: str | None, header: list[str], cases: list[Case], num_sms: int,
                 skipped: list[str]) -> str:  # fmt: skip
    body = [*header, *summary(cases), *tuned_literal(cases, num_sms)]
    if skipped:
        body.append("Skipped (time limit): " + ", ".join(skipped) + "\n")
    body += ["## Per case\n"] + [line for case in cases for line in case_table(case)]
    text = "\n".join(body)
    if path:
        Path(path).write_text(text)
    return text


# --------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="markdown report path")
    parser.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes")
    parser.add_argument("--time-limit", type=float, default=170.0, help="s for phase 2")
    parser.add_argument("--workers", type=int, default=max(1, min(12, (os.cpu_count() or 4) - 2)))
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    parser.add_argument("--max-variants", type=int, default=None, help="per case (dry run: 3)")
    parser.add_argument(
        "--convert",
        nargs="+",
        choices=("bits", "cvt", "half"),
        default=None,
        help="time only these variants' code conversions (and current)",
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        choices=[name for name, _, _ in SHAPES],
        default=None,
        help="only these projections (not with --dry-run)",
    )
    args = parser.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    tq = kernels()
    device = "cpu" if args.dry_run else "cuda"
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    if args.shapes and not args.dry_run:
        shapes = tuple(shape for shape in SHAPES if shape[0] in args.shapes)
    pick = Pick(args.max_variants or (3 if args.dry_run else None),
                tuple(args.convert) if args.convert else None)  # fmt: skip
    num_sms = tq._num_sms(torch.device(device))
    started = time.perf_counter()
    cases = [Case(s, name, n, k, m, 0) for m in args.batches for name, n, k in shapes
             for s in args.schemes]  # fmt: skip
    compile_errors: dict[tuple, str] = {}
    if not args.dry_run:
        by_weight = sorted(cases, key=lambda c: (c.scheme, c.n, c.k, c.m))
        tasks = [
            task_of(c, config, group_major)
            for c in by_weight
            for config, group_major in variants(tq, c.scheme, c.m, pick)
        ]
        compile_errors = compile_all(tasks, args.workers)
        failed = sorted({e for e in compile_errors.values() if e})
        for error in failed[:8]:  # the timing phase retries them (and reports what fails)
            print("compile worker error:", error, flush=True)
        print(
            f"compiled {len(tasks)} launches in {time.perf_counter() - started:.0f} s "
            f"({args.workers} processes), {len(failed)} distinct errors",
            flush=True,
        )
    compile_s = time.perf_counter() - started
    header = report_header(args, torch, num_sms, compile_s)
    time_us, done, skipped = timer(device), [], []
    gen = torch.Generator(device=device).manual_seed(0)
    for m in args.batches:
        for name, n, k in shapes:
            w_bf16 = (torch.randn(n, k, device=device, generator=gen) * 0.02).bfloat16()
            x = torch.randn(m, k, device=device, generator=gen).bfloat16()
            for case in (c for c in cases if (c.m, c.name) == (m, name)):
                if time.perf_counter() - started - compile_s > args.time_limit:
                    skipped.append(case.title)
                    continue
                ops = make_operands(tq, case.scheme, n, k, device, fill=True)
                case.nbytes = ops.nbytes
                run_case(tq, case, ops, x, w_bf16, compile_errors, time_us, num_sms,
                         pick)  # fmt: skip
                done.append(case)
                best = case.best()
                print(
                    f"{case.title}: best {fmt_us(best)} µs ({gbps(case, best and best.us)} "
                    f"GB/s) {best.label if best else ''}",
                    flush=True,
                )
                write_report(args.out, header, done, num_sms, skipped)
                del ops
            del w_bf16
            if device == "cuda":
                torch.cuda.empty_cache()
    total = time.perf_counter() - started
    header.append(f"total {total:.0f} s\n")
    print(write_report(args.out, header, done, num_sms, skipped), flush=True)
    return 1 if any(not r.ok for c in done for r in c.results) else 0


def report_header(args: argparse.Namespace, torch: types.ModuleType, num_sms: int,
                  compile_s: float) -> list[str]:  # fmt: skip
    import triton

    name = "CPU (interpreter)" if args.dry_run else torch.cuda.get_device_name()
    command = " ".join(["python3 scripts/gpu/sweep_quant_gemv.py", *sys.argv[1:]])
    return [f"# Quantized GEMV sweep on {name}\n",
            f"{datetime.datetime.now():%Y-%m-%d %H:%M}, torch {torch.__version__}, triton "
            f"{triton.__version__}, {num_sms} SMs; `{command}`; compile phase {compile_s:.0f} s; "
            f"x bf16 ~N(0, 1); µs = do_bench median (L2 flushed each call); GB/s = weight "
            f"bytes (with scales / zeros) / time\n"]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
