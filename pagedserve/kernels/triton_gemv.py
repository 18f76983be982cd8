"""A weight-streaming Triton GEMM for skinny batches: y = x @ W^T (+ b) with x [M, K], M <= 16
(decode steps), W [N, K] row-contiguous (the nn.Linear layout).

At such M the projection is bound by reading W once (N * K elements): cuBLAS picks tiles made
for large M and reaches ~1 TB/s of an H200's ~4.3 TB/s on these shapes. Here each program owns
BLOCK_N rows of W (= output columns), streams them along K in BLOCK_K chunks (coalesced, 16-byte
vector loads along the contiguous K) and applies them to all M rows of x at once, so every weight
byte is read exactly once. Two inner loops, picked per M bucket by `SKINNY_TUNING`:
  fma  (M <= 4)  x [BLOCK_M, BLOCK_K] * W [BLOCK_N, BLOCK_K] on CUDA cores, accumulated
                 elementwise in a [BLOCK_M, BLOCK_N, BLOCK_K] fp32 register tile and summed over
                 K once after the loop (no per-chunk cross-lane reduction);
  dot  (M > 4)   tl.dot of x [16, BLOCK_K] (rows >= M are padding) with W^T [BLOCK_K, BLOCK_N]
                 on tensor cores (fp32 accumulation; the padded rows are free: the kernel is
                 bandwidth-bound, and the loads are software-pipelined over num_stages).

Split-K: when cdiv(N, BLOCK_N) tiles are too few to fill the GPU (N = 1024 at BLOCK_N = 32 is
32 programs for 132 SMs), program (n, s) of a (tiles, S) grid covers K chunk s only, stores its
fp32 partial tile, and the LAST program of the tile to arrive (an acq_rel atomic counter per
tile) sums the S partials in split order, adds the bias, rounds once and stores; it then resets
the counter to 0 for the next launch. One launch, no zero-fill, no second reduction kernel, and
the result does not depend on the arrival order. The counters live in a small per-device
buffer zeroed once (split launches on a device must not run concurrently; see `_counters`).

Numerics: products and sums in fp32 (fp16/bf16 operands are exact in fp32), one final rounding
(nearest even) of acc + bias to the output dtype, like cuBLAS's fp32-accumulating GEMMs and
`F.linear(x.float(), W.float(), b.float()).to(dtype)` up to fp32 summation order. fp32 inputs use
IEEE fp32 dots (no TF32).

CUDA graphs: the grid, block sizes and split count come from the shapes only (no host sync, no
data-dependent launch); the partial workspace comes from torch's caching allocator.

Programmatic dependent launch (`dependent_launch`, sm_90; see triton_ops' docstring): the fma
loop loads its first weight chunk, then awaits the kernel before it (`await_inputs`) and only
then reads x, so the weights stream while that kernel drains; the dot loop awaits first. Split
counters and partials are touched only after the wait, so consecutive launches never overlap
there.

Tuning: `plan_skinny_linear` first looks up SKINNY_TUNED, per-shape configs measured on one GPU
model (keyed by its SM count, the M bucket, N and K), then falls back to the M bucket's
SKINNY_TUNING entry and the split-K heuristic. `scripts/gpu/sweep_gemv.py` times candidate
configs (blocks, warps, K splits, weight-load cache hints) against cuBLAS and prints SKINNY_TUNED
entries to paste here; `skinny_linear(..., config=...)` forces one config (the sweep's way in).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton_ops import _round, await_inputs

__all__ = [
    "SKINNY_MAX_M",
    "SKINNY_TUNING",
    "SKINNY_TUNED",
    "SkinnyConfig",
    "SkinnyPlan",
    "check_skinny_config",
    "plan_skinny_linear",
    "reference",
    "skinny_linear",
    "skinny_linear_applies",
]

SKINNY_MAX_M = 16
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


# --------------------------------------------------------------------------- tuning


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch parameters for batches of up to max_m rows. fma inner loop: the fp32 register
    tile holds BLOCK_M * block_n * block_k / (32 * num_warps) values per thread (32..64 here),
    and block_k >= 8 * 32 * num_warps (bf16) keeps every warp along K, so x and W load straight
    into the accumulator's layout; its plain loads are not software-pipelined (num_stages 1).
    dot inner loop: BLOCK_M = 16, block_n and block_k >= 16, loads pipelined (cp.async) over
    num_stages buffers.

    split_k: None picks the K splits by the heuristic (SKINNY_PROGRAMS_PER_SM), a number forces
    them (clamped to one BLOCK_K chunk per split at least). w_cache / w_evict: the cache
    modifier ("", ".ca", ".cg": L2 only, so L1 keeps x; ".cv") or else the eviction policy
    ("", "evict_first", "evict_last": L1 and L2 priority) of the weight loads, not both (ptxas
    rejects the pair); hints only, the results are the same.
    max_m only selects the SKINNY_TUNING bucket; a config passed to skinny_linear or found in
    SKINNY_TUNED applies as is."""

    max_m: int
    use_dot: bool
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int | None = None
    w_cache: str = ""
    w_evict: str = "evict_first"


# First guesses for an H200 (132 SMs); M = 1 measured in scripts/results/kernels_h200.md.
# Per-shape tuning goes into SKINNY_TUNED (`scripts/gpu/sweep_gemv.py`), a new default here
# after `bench_kernels.py --only gemv` confirms it on every shape. Each program streams
# block_n * block_k weight elements per K step (8 KB of bf16 for M = 1, 4 KB for M = 2..4, 8 KB
# per stage for the dot loop); the first entry whose max_m >= M applies.
SKINNY_TUNING: tuple[SkinnyConfig, ...] = (
    SkinnyConfig(max_m=1, use_dot=False, block_n=4, block_k=1024, num_warps=4, num_stages=1),
    SkinnyConfig(max_m=2, use_dot=False, block_n=2, block_k=1024, num_warps=4, num_stages=1),
    SkinnyConfig(max_m=4, use_dot=False, block_n=2, block_k=1024, num_warps=4, num_stages=1),
    SkinnyConfig(max_m=16, use_dot=True, block_n=32, block_k=128, num_warps=4, num_stages=4),
)
# Per-shape overrides measured by scripts/gpu/sweep_gemv.py (paste its printed literal here):
# (num_sms, max_m of the SKINNY_TUNING bucket, N, K) -> the config for every M of that bucket on
# a GPU of that many SMs, for 2-byte dtypes (fp16 / bf16) only. Measured on an H200 (132 SMs),
# 2026-11-29, scripts/results/gemv_sweep_h200.md; the shapes where the default was >= 2% slower.
# SkinnyConfig(max_m, use_dot, block_n, block_k, num_warps, num_stages, split_k, w_cache, w_evict)
SKINNY_TUNED: dict[tuple[int, int, int, int], SkinnyConfig] = {
    # qwen3-0.6b o_proj M=1 1024x2048: 4.7 -> 3.2 µs (cuBLAS 12.8)
    (132, 1, 1024, 2048): SkinnyConfig(1, False, 2, 2048, 8, 1, 1, "", "evict_first"),
    # qwen3-0.6b down M=1 1024x3072: 6.0 -> 4.0 µs (cuBLAS 7.5)
    (132, 1, 1024, 3072): SkinnyConfig(1, False, 2, 1024, 4, 1, 1, "", "evict_first"),
    # llama-3.1-8b o_proj M=1 4096x4096: 11.4 -> 10.7 µs (cuBLAS 13.3)
    (132, 1, 4096, 4096): SkinnyConfig(1, False, 2, 1024, 4, 1, 1, "", "evict_first"),
    # llama-3.1-8b down M=1 4096x14336: 33.6 -> 30.2 µs (cuBLAS 32.3)
    (132, 1, 4096, 14336): SkinnyConfig(1, False, 2, 1024, 4, 1, 1, "", "evict_first"),
    # qwen3-0.6b gate_up M=1 6144x1024: 5.5 -> 5.2 µs (cuBLAS 6.2)
    (132, 1, 6144, 1024): SkinnyConfig(1, False, 4, 512, 2, 1, 1, "", "evict_first"),
    # qwen3-0.6b lm_head M=1 151936x1024: 74.4 -> 71.2 µs (cuBLAS 78.6)
    (132, 1, 151936, 1024): SkinnyConfig(1, False, 4, 512, 2, 1, 1, "", "evict_first"),
    # The speculative benchmark's ~94M target (train_tiny_model.py's `target` preset), measured
    # on an H100 (132 SMs), 2026-12-07, scripts/results/session33/call1/sweep_target.md.
    # down M=1 640x1728: 3.9 -> 2.8 µs (cuBLAS 5.5)
    (132, 1, 640, 1728): SkinnyConfig(1, False, 2, 2048, 8, 1, 1, "", "evict_first"),
    # Its verify rows (M <= 16, with small_batch_gemm_rows = 16): qkv 1280x640 4.4 -> 3.5 µs
    # (cuBLAS 3.9), o_proj 640x640 3.8 -> 3.3 (3.7), gate_up 3456x640 5.6 -> 4.3 (4.7), down
    # 640x1728 5.0 -> 4.7 (5.3), lm_head 4096x640 5.8 -> 4.6 (4.8)
    (132, 16, 1280, 640): SkinnyConfig(16, True, 16, 128, 4, 4, 1, ".cg", ""),
    (132, 16, 640, 640): SkinnyConfig(16, True, 16, 128, 4, 4, 1, ".cg", ""),
    (132, 16, 3456, 640): SkinnyConfig(16, True, 32, 128, 4, 4, 1, "", ""),
    (132, 16, 640, 1728): SkinnyConfig(16, True, 32, 128, 4, 4, 4, ".cg", ""),
    (132, 16, 4096, 640): SkinnyConfig(16, True, 32, 128, 4, 4, 1, "", "evict_first"),
}
_W_CACHE_MODIFIERS = ("", ".ca", ".cg", ".cv")
_W_EVICTION_POLICIES = ("", "evict_first", "evict_last")

# Split K until about SKINNY_PROGRAMS_PER_SM programs per SM are in flight (more loads in
# flight hide HBM latency), with at most SKINNY_MAX_SPLIT_K splits, at least one BLOCK_K chunk
# each, and fp32 partials (written and read once: 8 * split * M * N bytes) of at most
# 1 / SKINNY_PARTIAL_BUDGET of the weight bytes.
SKINNY_PROGRAMS_PER_SM = 4
SKINNY_MAX_SPLIT_K = 16
SKINNY_PARTIAL_BUDGET = 2
_CPU_SMS = 4  # the interpreter's stand-in SM count (tests)
_COUNTER_SLOTS = 4096  # per-tile arrival counters: split-K only when the tiles fit


@dataclass(frozen=True)
class SkinnyPlan:
    """One launch: a (tiles, split_k) grid, program (n, s) covering W rows [n * block_n,
    (n + 1) * block_n) and K range [s * k_per_split, (s + 1) * k_per_split)."""

    use_dot: bool
    block_m: int
    block_n: int
    block_k: int
    tiles: int
    split_k: int
    k_per_split: int
    num_warps: int
    num_stages: int
    w_cache: str = ""
    w_evict: str = "evict_first"

    @property
    def programs(self) -> int:
        return self.tiles * self.split_k

    def describe(self) -> str:
        loop = "dot" if self.use_dot else "fma"
        hints = f" w_cache{self.w_cache}" if self.w_cache else ""
        if self.w_evict != "evict_first":
            hints += f" w_evict={self.w_evict or 'none'}"
        return (
            f"{loop} BM{self.block_m} BN{self.block_n} BK{self.block_k} split{self.split_k} "
            f"w{self.num_warps} s{self.num_stages}{hints}: {self.programs} programs"
        )


def plan_skinny_linear(
    m: int,
    n: int,
    k: int,
    num_sms: int,
    split_k: int | None = None,
    element_size: int = 2,
    *,
    config: SkinnyConfig | None = None,
) -> SkinnyPlan:
    """The launch for x [m, k] @ W[n, k]^T on a GPU of num_sms SMs: `config` if given, else the
    SKINNY_TUNED entry for (num_sms, m's bucket, n, k) (2-byte dtypes), else the SKINNY_TUNING
    entry of m's bucket; its blocks clamped to the problem, and split_k (None: the config's
    split_k, and if that is None automatic, see SKINNY_PROGRAMS_PER_SM) splits of K, each a
    whole number of BLOCK_K chunks. Shapes only: the same plan on every call."""
    _check(1 <= m <= SKINNY_MAX_M, f"M must be in 1..{SKINNY_MAX_M}, got {m}")
    _check(n >= 1 and k >= 1, "N and K must be >= 1")
    if config is None:
        config = next(c for c in SKINNY_TUNING if m <= c.max_m)
        if element_size == 2:
            config = SKINNY_TUNED.get((num_sms, config.max_m, n, k), config)
    _check_config_once(config)
    if split_k is None:
        split_k = config.split_k
    floor = 16 if config.use_dot else 1  # tl.dot needs every dimension >= 16
    block_m = 16 if config.use_dot else triton.next_power_of_2(m)
    block_n = max(floor, min(config.block_n, triton.next_power_of_2(n)))
    block_k = max(16, min(config.block_k, triton.next_power_of_2(k)))
    tiles = triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, block_k)
    if split_k is None:
        target = SKINNY_PROGRAMS_PER_SM * num_sms
        partial_bound = k * element_size // (8 * SKINNY_PARTIAL_BUDGET * m)
        split_k = max(1, min(target // tiles, SKINNY_MAX_SPLIT_K, partial_bound))
    _check(split_k >= 1, "split_k must be >= 1")
    if tiles > _COUNTER_SLOTS:
        split_k = 1
    k_per_split = triton.cdiv(k_blocks, min(split_k, k_blocks)) * block_k
    return SkinnyPlan(
        use_dot=config.use_dot,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        tiles=tiles,
        split_k=triton.cdiv(k, k_per_split),  # no empty splits
        k_per_split=k_per_split,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        w_cache=config.w_cache,
        w_evict=config.w_evict,
    )


def check_skinny_config(config: SkinnyConfig) -> None:
    """ValueError unless config is launchable: power-of-two blocks and warps, num_stages >= 1,
    split_k None or >= 1, known weight-load hints."""
    for name in ("block_n", "block_k", "num_warps"):
        value = getattr(config, name)
        _check(value >= 1 and value & (value - 1) == 0, f"{name} must be a power of 2: {config}")
    _check(config.num_warps <= 32 and config.num_stages >= 1, f"bad warps / stages: {config}")
    _check(config.split_k is None or config.split_k >= 1, f"split_k must be >= 1: {config}")
    _check(config.w_cache in _W_CACHE_MODIFIERS, f"w_cache not in {_W_CACHE_MODIFIERS}: {config}")
    _check(config.w_evict in _W_EVICTION_POLICIES,
           f"w_evict not in {_W_EVICTION_POLICIES}: {config}")  # fmt: skip
    # the fma loop's ld.global takes a cache operator or an L1 eviction priority, not both
    _check(not (config.w_cache and config.w_evict),
           f"w_cache and w_evict exclude each other (set w_evict=''): {config}")  # fmt: skip


_check_config_once = functools.cache(check_skinny_config)  # configs are frozen (hashable)


# --------------------------------------------------------------------------- kernel


@triton.jit
def _fma_mainloop(
    x_ptrs,
    w_ptrs,
    k_start,
    k_end,
    M,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    W_CACHE: tl.constexpr,
    W_EVICT: tl.constexpr,
    PDL: tl.constexpr,
):
    """sum over k in [k_start, k_end) of x[m, k] * w[n, k] in fp32 -> [BLOCK_M, BLOCK_N]:
    elementwise products accumulated in a [BLOCK_M, BLOCK_N, BLOCK_K] tile, reduced once after
    the loop. x and w are loaded as 3-D [BLOCK_M, 1, BLOCK_K] / [1, BLOCK_N, BLOCK_K] tiles so
    both get the accumulator's layout (no per-chunk shared-memory layout conversion). The first
    chunk's weights are loaded before await_inputs(PDL), x after."""
    rk = tl.arange(0, BLOCK_K)[None, None, :]
    x_row_ok = (tl.arange(0, BLOCK_M) < M)[:, None, None]
    x3 = x_ptrs[:, None, :]
    w3 = w_ptrs[None, :, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w3, cache_modifier=W_CACHE, eviction_policy=W_EVICT)
        else:
            w = tl.load(w3, mask=k + rk < K, other=0.0, cache_modifier=W_CACHE,
                        eviction_policy=W_EVICT)  # fmt: skip
        if k == k_start:  # the first weights (constant) are in flight while it waits
            await_inputs(PDL)
        if EVEN_K:
            x = tl.load(x3, mask=x_row_ok, other=0.0)
        else:
            x = tl.load(x3, mask=x_row_ok & (k + rk < K), other=0.0)
        acc += x.to(tl.float32) * w.to(tl.float32)
        x3 += BLOCK_K
        w3 += BLOCK_K
    return tl.sum(acc, axis=2)


@triton.jit
def _dot_mainloop(
    x_ptrs,
    w_ptrs,
    k_start,
    k_end,
    M,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    W_CACHE: tl.constexpr,
    W_EVICT: tl.constexpr,
):
    """The same sum as tl.dot(x, W^T) tiles accumulated in fp32 (x rows >= M load as zeros: no
    memory traffic). UPCAST (CPU interpreter only): the interpreter multiplies bf16 as raw
    integers, so operands go through fp32 (exact)."""
    rk = tl.arange(0, BLOCK_K)[None, :]
    x_row_ok = (tl.arange(0, BLOCK_M) < M)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=x_row_ok, other=0.0)
            w = tl.load(w_ptrs, cache_modifier=W_CACHE, eviction_policy=W_EVICT)
        else:
            in_k = (k + rk) < K
            x = tl.load(x_ptrs, mask=x_row_ok & in_k, other=0.0)
            w = tl.load(w_ptrs, mask=in_k, other=0.0, cache_modifier=W_CACHE,
                        eviction_policy=W_EVICT)  # fmt: skip
        if UPCAST:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                         input_precision="ieee")  # fmt: skip
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _store_tile(
    out_ptr,
    bias_ptr,
    acc,
    rm,
    rn,
    M,
    N,
    stride_om,
    HAS_BIAS: tl.constexpr,
):
    """out[m, n] = round(acc[m, n] + bias[n]) for the in-bounds (m, n) of the tile."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + tl.minimum(rn, N - 1))
        acc += bias.to(tl.float32)[None, :]
    out_dtype = out_ptr.dtype.element_ty
    out = _round(acc, out_dtype).to(out_dtype)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], out, mask=mask)


@triton.jit
def split_k_finish(acc, out_ptr, bias_ptr, partial_ptr, counter_ptr, rm, rn, M, N,
                   stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_BIAS: tl.constexpr):  # fmt: skip
    """Store this split's partial tile (program (t, s): partial[s, t]); the tile's last program
    to arrive (counter[t] counts arrivals, acq_rel) sums the partials in split order, stores
    the output and resets counter[t] to 0 (the skinny GEMVs' split-K, here and triton_quant)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_splits = tl.num_programs(1)
    split_stride = tl.num_programs(0) * (BLOCK_M * BLOCK_N)
    tile = (pid_n * BLOCK_M + rm[:, None]) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    row_ok = rm[:, None] < M
    tl.store(partial_ptr + pid_k * split_stride + tile, acc, mask=row_ok)
    tl.debug_barrier()  # every thread's partial is written before the release below
    arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    if arrived == num_splits - 1:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(0, num_splits):  # split order: independent of the arrival order
            total += tl.load(partial_ptr + s * split_stride + tile, mask=row_ok, other=0.0,
                             cache_modifier=".cg")  # fmt: skip
        _store_tile(out_ptr, bias_ptr, total, rm, rn, M, N, stride_om, HAS_BIAS)
        tl.store(counter_ptr + pid_n, 0)


@triton.jit
def _skinny_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    W_CACHE: tl.constexpr,
    W_EVICT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (t, s) of a (tiles, S) grid, rows n in [t * BLOCK_N, (t + 1) * BLOCK_N) of W,
    K range [s * k_per_split, min((s + 1) * k_per_split, K)):
      P_s[m, n] = sum_k x[m, k] * W[n, k]   (fp32; fp16/bf16 products are exact in fp32)
      S == 1:  out[m, n] = round(P_0[m, n] + b[n])
      S > 1:   P_s is stored to partial[s, t]; the last of the tile's S programs to arrive
               (counter[t] counts arrivals; acq_rel) computes
               out[m, n] = round((((P_0 + P_1) + P_2) + ... + P_{S-1})[m, n] + b[n])
               and resets counter[t] = 0.
    round = nearest-even to out's dtype, once. Rows m >= M of the tile load x as zeros; columns
    n >= N read the clamped row N - 1 of W (every W load in bounds, no row mask); neither is
    stored. W_CACHE / W_EVICT: the weight loads' cache modifier and eviction policy (hints).
    PDL: launched as a programmatic dependent (see the module's docstring)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = x_ptr + (rm.to(tl.int64) * stride_xm)[:, None] + (k_start + rk)[None, :]
    w_rows = tl.minimum(rn, N - 1).to(tl.int64) * K
    w_ptrs = w_ptr + w_rows[:, None] + (k_start + rk)[None, :]
    if USE_DOT:
        await_inputs(PDL)
        acc = _dot_mainloop(x_ptrs, w_ptrs, k_start, k_end, M, K, BLOCK_M, BLOCK_N, BLOCK_K,
                            EVEN_K, PRECISION, UPCAST, W_CACHE, W_EVICT)  # fmt: skip
    else:
        acc = _fma_mainloop(x_ptrs, w_ptrs, k_start, k_end, M, K, BLOCK_M, BLOCK_N, BLOCK_K,
                            EVEN_K, W_CACHE, W_EVICT, PDL)  # fmt: skip
    if SPLIT:
        split_k_finish(acc, out_ptr, bias_ptr, partial_ptr, counter_ptr, rm, rn, M, N,
                       stride_om, BLOCK_M, BLOCK_N, HAS_BIAS)  # fmt: skip
    else:
        _store_tile(out_ptr, bias_ptr, acc, rm, rn, M, N, stride_om, HAS_BIAS)


# --------------------------------------------------------------------------- launcher


def skinny_linear_applies(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> bool:
    """Whether skinny_linear takes these operands: x [..., K] with 1..SKINNY_MAX_M rows in all
    and a contiguous K dim, weight [N, K] contiguous, bias None or [N] contiguous, one float
    dtype and one device for all."""
    if x.dim() < 1 or weight.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        return False
    n, k = weight.shape
    if x.shape[-1] != k or k == 0 or n == 0 or x.stride(-1) != 1:
        return False
    if not 1 <= x.numel() // k <= SKINNY_MAX_M:
        return False
    if weight.dtype != x.dtype or weight.device != x.device or not weight.is_contiguous():
        return False
    return bias is None or (
        bias.shape == (n,)
        and bias.dtype == x.dtype
        and bias.device == x.device
        and bias.is_contiguous()
    )


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    split_k: int | None = None,
    config: SkinnyConfig | None = None,
    dependent_launch: bool = False,
) -> torch.Tensor:
    """x @ weight.T (+ bias), as F.linear, for x [..., K] with at most SKINNY_MAX_M rows in all.

    x: fp16/bf16/fp32, contiguous along K (rows may be strided: a view of a wider buffer is
    fine); weight [N, K] contiguous, x's dtype; bias [N] or None, x's dtype. Returns a new
    [..., N] tensor of x's dtype. config forces the launch config (None: SKINNY_TUNED, else the
    M bucket's SKINNY_TUNING entry); split_k forces the number of K splits over the config's
    (None: the config's, else enough programs for the SM count, see plan_skinny_linear).
    dependent_launch: as a programmatic dependent of the kernel before it (CUDA sm_90).
    Raises ValueError on anything else."""
    _check(x.dtype in _FLOAT_DTYPES, f"dtype {x.dtype} unsupported")
    _check(weight.dim() == 2, "weight must be [N, K]")
    _check(weight.dtype == x.dtype, f"weight dtype {weight.dtype} differs from x's {x.dtype}")
    _check(weight.device == x.device, "weight is on another device")
    _check(weight.is_contiguous(), "weight must be contiguous ([N, K], row stride K)")
    n, k = weight.shape
    _check(x.dim() >= 1 and x.shape[-1] == k, f"x must be [..., {k}] (weight's K)")
    _check(k >= 1 and n >= 1, "N and K must be >= 1")
    if bias is not None:
        _check(bias.shape == (n,), f"bias must be [{n}]")
        _check(bias.dtype == x.dtype, f"bias dtype {bias.dtype} differs from x's {x.dtype}")
        _check(bias.device == x.device, "bias is on another device")
        _check(bias.is_contiguous(), "bias must be contiguous")
    x2d = x.reshape(-1, k)
    m = x2d.shape[0]
    _check(m <= SKINNY_MAX_M, f"x has {m} rows, more than SKINNY_MAX_M = {SKINNY_MAX_M}")
    _check(x2d.stride(1) == 1, "x must be contiguous along K")
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    plan = plan_skinny_linear(m, n, k, _num_sms(x.device), split_k, x.element_size(),
                              config=config)  # fmt: skip
    counters = partials = out
    if plan.split_k > 1:
        counters = _counters(x.device)
        if counters is None:  # first use inside a CUDA graph capture: no split this time
            plan = plan_skinny_linear(m, n, k, _num_sms(x.device), 1, x.element_size(),
                                      config=config)  # fmt: skip
            counters = out
        else:
            shape = (plan.split_k, plan.tiles, plan.block_m, plan.block_n)
            partials = torch.empty(shape, dtype=torch.float32, device=x.device)
    _skinny_linear_kernel[(plan.tiles, plan.split_k)](
        x2d, weight, bias if bias is not None else weight, out, partials, counters,
        m, n, k, x2d.stride(0), n, plan.k_per_split,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        USE_DOT=plan.use_dot, EVEN_K=k % plan.block_k == 0, SPLIT=plan.split_k > 1,
        HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=x.device.type == "cpu" and x.dtype == torch.bfloat16,
        W_CACHE=plan.w_cache, W_EVICT=plan.w_evict, PDL=dependent_launch,
        launch_pdl=dependent_launch, num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    return out


def reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The pure-torch reference: F.linear in fp32, rounded once to x's dtype."""
    fp32_bias = None if bias is None else bias.float()
    return torch.nn.functional.linear(x.float(), weight.float(), fp32_bias).to(x.dtype)


# --------------------------------------------------------------------------- helpers


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _CPU_SMS
    return _cuda_num_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor | None:
    """The device's split-K arrival counters: _COUNTER_SLOTS int32 zeros, allocated once and
    left zeroed by every launch (the last program of a tile resets its slot). Shared by every
    split launch on the device, so two of them must not run at the same time (on two streams
    at once); the engine runs its forwards, eager or replayed from CUDA graphs, on one stream.
    None when the buffer does not exist yet and a CUDA graph is being captured (its zero-fill
    would only run at replay): that launch does not split."""
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _COUNTERS[device] = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32,
                                                   device=device)  # fmt: skip
    return counters
