"""Launch geometry of the CUDA quantized GEMV (kernels.cuda_quant, csrc/quant_gemv*): a
`GemvConfig` (warps a CTA, K splits, weight steps in flight a thread) from QUANT_CUDA_TUNED
(scripts/gpu/check_quant_cuda.py measures them on the GPU and prints this table's literal), else
the scheme's DEFAULTS with the splits chosen so that about TARGET_WARPS_PER_SM warps an SM run
and the staged x fits; `plan_gemv` turns it into a `GemvPlan` for one product shape.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

# the kernel's constants (csrc/quant_gemv.h)
MAX_ROWS = 16
STEP_K = 128
TILE_N = 16
MAX_SPLITS = 8
MAX_WARPS = 8
X_ROW_PAD = 64

SHARED_BYTES_LIMIT = 200 * 1024  # a CTA's dynamic shared memory (the H200 grants 227 KiB)
AUTO_SHARED_BYTES = 64 * 1024  # the automatic splits keep a CTA's below this (occupancy)
TARGET_WARPS_PER_SM = 32


@dataclass(frozen=True)
class GemvConfig:
    """warps: a CTA's warps (16 weight rows each), 1..MAX_WARPS; splits: CTAs along K (one
    cluster), 1..MAX_SPLITS, None = automatic; unroll: the weight steps a thread's ring holds
    (2, 4)."""

    warps: int = 4
    splits: int | None = None
    unroll: int = 4

    def describe(self) -> str:
        return f"w{self.warps} split{'auto' if self.splits is None else self.splits} u{self.unroll}"


@dataclass(frozen=True)
class GemvPlan:
    warps: int
    splits: int
    k_per_split: int
    unroll: int
    shared_bytes: int


# per scheme: int4 keeps 4 steps (64 bytes a row) in flight a thread, 8-bit codes 2 (as many
# bytes; their 4-step kernels spill)
DEFAULTS = {"int4": GemvConfig(4, None, 4), "int8": GemvConfig(4, None, 2),
            "fp8": GemvConfig(4, None, 2)}  # fmt: skip
# (SM count, scheme, M bucket (8: M <= 8, else 16), N, K) -> the fastest config measured by
# scripts/gpu/check_quant_cuda.py (its literal; scripts/results/session9/call2_quant_cuda.md:
# H200, 132 SMs); Llama's int4 M <= 8 rows re-measured after the kernel's step lost ~70
# instructions (session 18: scripts/results/session18/call2_tiles.md, the "rows" columns)
QUANT_CUDA_TUNED: dict[tuple[int, str, int, int, int], GemvConfig] = {
    # llama8b qkv 6144x4096 fp8 M=4: 18.6 -> 14.2 µs
    (132, "fp8", 8, 6144, 4096): GemvConfig(8, 4, 2),
    # llama8b qkv 6144x4096 fp8 M=16: 26.4 -> 19.2 µs
    (132, "fp8", 16, 6144, 4096): GemvConfig(8, 4, 2),
    # llama8b qkv 6144x4096 int8 M=4: 20.1 -> 16.6 µs
    (132, "int8", 8, 6144, 4096): GemvConfig(8, 4, 2),
    # llama8b qkv 6144x4096 int8 M=16: 29.4 -> 22.3 µs
    (132, "int8", 16, 6144, 4096): GemvConfig(8, 4, 2),
    # llama8b qkv 6144x4096 int4 M=1: 12.9 -> 12.5 µs (session 18, call 2)
    (132, "int4", 8, 6144, 4096): GemvConfig(4, 4, 2),
    # llama8b qkv 6144x4096 int4 M=16: 26.3 -> 19.4 µs
    (132, "int4", 16, 6144, 4096): GemvConfig(8, 4, 4),
    # llama8b o_proj 4096x4096 fp8 M=16: 21.9 -> 18.1 µs
    (132, "fp8", 16, 4096, 4096): GemvConfig(4, 4, 2),
    # llama8b o_proj 4096x4096 int8 M=1: 16.4 -> 13.5 µs
    (132, "int8", 8, 4096, 4096): GemvConfig(4, 4, 2),
    # llama8b o_proj 4096x4096 int8 M=16: 24.0 -> 20.7 µs
    (132, "int8", 16, 4096, 4096): GemvConfig(4, 4, 2),
    # llama8b o_proj 4096x4096 int4 M=1: 11.0 -> 10.8 µs (session 18, call 2)
    (132, "int4", 8, 4096, 4096): GemvConfig(4, None, 2),
    # llama8b o_proj 4096x4096 int4 M=16: 21.8 -> 17.7 µs
    (132, "int4", 16, 4096, 4096): GemvConfig(4, None, 2),
    # llama8b gate_up 28672x4096 fp8 M=1: 47.1 -> 34.1 µs
    (132, "fp8", 8, 28672, 4096): GemvConfig(8, 1, 2),
    # llama8b gate_up 28672x4096 fp8 M=16: 73.5 -> 56.2 µs
    (132, "fp8", 16, 28672, 4096): GemvConfig(8, 2, 4),
    # llama8b gate_up 28672x4096 int8 M=4: 54.5 -> 43.2 µs
    (132, "int8", 8, 28672, 4096): GemvConfig(8, 1, 2),
    # llama8b gate_up 28672x4096 int8 M=16: 88.1 -> 67.6 µs
    (132, "int8", 16, 28672, 4096): GemvConfig(8, 2, 2),
    # llama8b gate_up 28672x4096 int4 M=1: 30.3 -> 29.1 µs (session 18, call 2)
    (132, "int4", 8, 28672, 4096): GemvConfig(8, 1, 2),
    # llama8b gate_up 28672x4096 int4 M=16: 74.6 -> 57.0 µs
    (132, "int4", 16, 28672, 4096): GemvConfig(8, 2, 4),
    # llama8b down 4096x14336 fp8 M=16: 49.2 -> 42.9 µs
    (132, "fp8", 16, 4096, 14336): GemvConfig(8, 8, 2),
    # llama8b down 4096x14336 int8 M=1: 34.5 -> 32.4 µs
    (132, "int8", 8, 4096, 14336): GemvConfig(4, 4, 2),
    # llama8b down 4096x14336 int8 M=16: 58.1 -> 52.1 µs
    (132, "int8", 16, 4096, 14336): GemvConfig(8, 8, 2),
    # llama8b down 4096x14336 int4 M=1: 20.1 -> 20.0 µs (session 18, call 2)
    (132, "int4", 8, 4096, 14336): GemvConfig(4, 8, 2),
    # llama8b down 4096x14336 int4 M=16: 51.2 -> 44.6 µs
    (132, "int4", 16, 4096, 14336): GemvConfig(8, 8, 4),
    # qwen0.6b qkv 4096x1024 fp8 M=1: 7.8 -> 6.4 µs
    (132, "fp8", 8, 4096, 1024): GemvConfig(4, 1, 4),
    # qwen0.6b qkv 4096x1024 fp8 M=16: 13.9 -> 9.3 µs
    (132, "fp8", 16, 4096, 1024): GemvConfig(8, 1, 4),
    # qwen0.6b qkv 4096x1024 int8 M=4: 11.2 -> 7.8 µs
    (132, "int8", 8, 4096, 1024): GemvConfig(4, 2, 2),
    # qwen0.6b qkv 4096x1024 int8 M=16: 14.3 -> 10.3 µs
    (132, "int8", 16, 4096, 1024): GemvConfig(4, 2, 2),
    # qwen0.6b qkv 4096x1024 int4 M=1: 10.6 -> 6.4 µs
    (132, "int4", 8, 4096, 1024): GemvConfig(4, 1, 4),
    # qwen0.6b qkv 4096x1024 int4 M=16: 13.7 -> 9.5 µs
    (132, "int4", 16, 4096, 1024): GemvConfig(4, 4, 2),
    # qwen0.6b o_proj 1024x2048 fp8 M=4: 7.1 -> 6.7 µs
    (132, "fp8", 8, 1024, 2048): GemvConfig(4, None, 4),
    # qwen0.6b gate_up 6144x1024 fp8 M=1: 12.2 -> 6.9 µs
    (132, "fp8", 8, 6144, 1024): GemvConfig(4, 1, 4),
    # qwen0.6b gate_up 6144x1024 fp8 M=16: 17.3 -> 9.6 µs
    (132, "fp8", 16, 6144, 1024): GemvConfig(8, 1, 4),
    # qwen0.6b gate_up 6144x1024 int8 M=1: 12.6 -> 8.3 µs
    (132, "int8", 8, 6144, 1024): GemvConfig(4, 1, 4),
    # qwen0.6b gate_up 6144x1024 int8 M=16: 17.6 -> 11.1 µs
    (132, "int8", 16, 6144, 1024): GemvConfig(8, 2, 2),
    # qwen0.6b gate_up 6144x1024 int4 M=1: 11.9 -> 6.6 µs
    (132, "int4", 8, 6144, 1024): GemvConfig(4, 1, 4),
    # qwen0.6b gate_up 6144x1024 int4 M=16: 17.1 -> 9.7 µs
    (132, "int4", 16, 6144, 1024): GemvConfig(8, 1, 4),
    # qwen0.6b down 1024x3072 fp8 M=4: 7.7 -> 7.4 µs
    (132, "fp8", 8, 1024, 3072): GemvConfig(4, None, 4),
    # qwen0.6b down 1024x3072 fp8 M=16: 10.5 -> 9.7 µs
    (132, "fp8", 16, 1024, 3072): GemvConfig(8, None, 2),
    # qwen0.6b down 1024x3072 int8 M=16: 10.8 -> 10.2 µs
    (132, "int8", 16, 1024, 3072): GemvConfig(8, 8, 2),
    # qwen0.6b down 1024x3072 int4 M=16: 10.6 -> 9.7 µs
    (132, "int4", 16, 1024, 3072): GemvConfig(8, 8, 4),
}


def shared_bytes(scheme: str, m: int, k_per_split: int, warps: int, splits: int) -> int:
    """A CTA's dynamic shared memory (pagedserve_quant::shared_bytes): the staged x rows, the
    per-step sums of x (int schemes), and the partial outputs (splits > 1)."""
    x_rows = m * (k_per_split * 2 + X_ROW_PAD)
    sums = 0 if scheme == "fp8" else (k_per_split // STEP_K) * MAX_ROWS * 4
    partials = warps * TILE_N * 8 * (2 if m > 8 else 1) * 4 if splits > 1 else 0
    return x_rows + sums + partials


def check_config(config: GemvConfig) -> None:
    """ValueError unless the config is launchable."""
    if not 1 <= config.warps <= MAX_WARPS or config.unroll not in (2, 4):
        raise ValueError(f"warps 1..{MAX_WARPS} and unroll 2 or 4: {config}")
    if config.splits is not None and not 1 <= config.splits <= MAX_SPLITS:
        raise ValueError(f"splits 1..{MAX_SPLITS} (None: automatic): {config}")


@functools.lru_cache(maxsize=4096)
def plan_gemv(
    scheme: str, m: int, n: int, k: int, num_sms: int, config: GemvConfig | None = None
) -> GemvPlan | None:
    """The launch of an M-row product with an [n, k] weight (k a multiple of STEP_K): `config`,
    else the tuned one, else the scheme's default; automatic splits: enough for
    TARGET_WARPS_PER_SM warps an SM, more while a CTA's shared memory exceeds AUTO_SHARED_BYTES.
    None when no split count fits SHARED_BYTES_LIMIT."""
    if config is None:
        bucket = 8 if m <= 8 else MAX_ROWS
        config = QUANT_CUDA_TUNED.get((num_sms, scheme, bucket, n, k), DEFAULTS[scheme])
    check_config(config)
    steps = k // STEP_K
    most = min(MAX_SPLITS, steps)
    tiles = -(-n // TILE_N)
    if config.splits is None:
        splits = max(1, min(most, -(-TARGET_WARPS_PER_SM * num_sms // tiles)))
        while (
            splits < most and _plan(scheme, m, steps, config.warps, splits)[1] > AUTO_SHARED_BYTES
        ):
            splits += 1
    else:
        splits = min(config.splits, most)
    k_per_split, smem = _plan(scheme, m, steps, config.warps, splits)
    if smem > SHARED_BYTES_LIMIT:
        return None
    splits = -(-k // k_per_split)
    return GemvPlan(config.warps, splits, k_per_split, config.unroll, smem)


def _plan(scheme: str, m: int, steps: int, warps: int, splits: int) -> tuple[int, int]:
    """(k_per_split, shared bytes) of `splits` splits of `steps` steps."""
    k_per_split = -(-steps // splits) * STEP_K
    return k_per_split, shared_bytes(scheme, m, k_per_split, warps, splits)
