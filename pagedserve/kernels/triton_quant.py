"""Triton kernels of the quantized linear layers (layouts and references: kernels.quant_ref).

- `_quant_gemv_kernel` (skinny batches, M <= WQ_GEMV_MAX_ROWS: decode): y = x @ W^T (+ b) with
  W read once in its quantized form (fp8: 1 byte a weight, int8: 1, int4: 0.5) and dequantized
  in registers. The structure of the bf16 GEMV (kernels.triton_gemv): a (tiles, splits) grid,
  program (t, s) owning BLOCK_N output channels and the K range of split s, the weight tile
  loaded as wide contiguous vectors along K (16 bytes a thread: 16 fp8 / int8 codes or 4 int32
  words = 32 int4 codes), split K reduced by the last program of the tile to arrive (see
  triton_gemv's module doc: one launch, the order of the sum fixed). Per scheme:

    fp8   acc[m, n, k] += x[m, k] * Wq[n, k] over the split's K chunks (fma), or
          acc = tl.dot(x, Wq^T, acc) (dot); after the loop out = sum_k acc * sw[n]
    int   each chunk of BLOCK_K columns lies in one group g (BLOCK_K divides the group size):
          P[m, n] = sum_k x[m, k] * q[n, k]          (exact codes; fma reduce or tl.dot)
          acc[m, n] += s[n, g] * (P[m, n] - z[n, g] * sum_k x[m, k])
          = sum_k x[m, k] * (q[n, k] - z[n, g]) * s[n, g]
          or ("tile", fma) acc[m, n, k] += x[m, k] * (q s - z s)[n, k], reduced after the loop

  int4 words are loaded as a [BLOCK_N, BLOCK_K / 8] int32 tile and unpacked in registers (code k
  is nibble k % 8 of word k // 8: `tl.interleave` three times then shifts, or shifts on a
  [.., 8] axis and `tl.reshape`). Codes become floats by a conversion instruction ("cvt") or by
  building their bits ("bits": 2^23 + q as fp32 bits, minus 2^23, on the ALU / FMA pipes; fp8:
  its sign, exponent and mantissa placed into fp16 bits, = value * 2^-8, undone in the scale;
  tl.dot with 16-bit x: OFFSET + q as bf16 / fp16 bits, OFFSET * sum_k x subtracted after),
  or ("half", integer fma loops) as fp16 bits 0x6400 | q = 1024 + q widened to fp32, the 1024
  folded into the zero point (one subtraction a group: s (sum_k x v - (z + 1024) sum_k x));
  int4 "planes" + "half" builds two codes a bit operation, ((word >> 4 p) & 0x000F000F) |
  0x64006400 (_int4_half_planes_chunk).
  Launch parameters: QuantGemvConfig, looked up per (SMs, scheme, M bucket, N, K) in
  QUANT_GEMV_TUNED (scripts/gpu/sweep_quant_gemv.py measures them), else QUANT_GEMV_DEFAULTS.
- `_dequantize_kernel` (large batches): W [N, K] in x's dtype from the integer layout, for a
  cuBLAS matmul after (a prefill chunk is compute-bound; the dequantized copy is transient).
- `_quantize_fp8_rows_kernel`: activations to fp8 for torch._scaled_mm, per token (scale
  amax|x_m| / 448, two passes over the row) or with one static scale.

Numerics: fp32 accumulation, one rounding of acc (+ bias) to the output dtype (nearest even;
bf16 by integer ops, as triton_ops._round does, because the CPU interpreter truncates casts).

Programmatic dependent launch (the GEMV's `dependent_launch`, sm_90; triton_ops' docstring):
the fma loops load their first chunks' weights, then `await_inputs` before they read x; the dot
loops await first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from pagedserve.kernels.quant_ref import FP8_DTYPE, FP8_MAX, IntWeight
from pagedserve.kernels.triton_gemv import _counters, _num_sms, _store_tile, split_k_finish
from pagedserve.kernels.triton_ops import _round, _round_fp8, await_inputs

WQ_GEMV_MAX_ROWS = 16
QUANT_KINDS = ("fp8", "int8", "int4")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_KINDS = {4: "int4", 8: "int8"}
_DOT_OFFSETS = {torch.bfloat16: 128.0, torch.float16: 1024.0}  # "bits" dot operands, see doc
HALF_OFFSET: tl.constexpr = tl.constexpr(1024.0)  # "half" codes: fp16 bits 0x6400 | q = 1024 + q


# --------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class QuantGemvConfig:
    """Launch parameters of the quantized GEMV. block_k: weight columns (codes) a step, a
    power of two; for the integer schemes clamped to a divisor of the group size. unroll:
    steps whose weight loads are issued together (bytes in flight; fma only). split_k: None
    = automatic (about QUANT_PROGRAMS_PER_SM programs an SM). convert: "bits", "cvt" or "half"
    (integer codes, fma loops; module doc); unpack (int4): "interleave", "reshape" or "planes"
    (left packed); w_evict: the weight loads' L1/L2 eviction policy ("" or "evict_first");
    accumulate (integer fma loop):
    "chunk" (reduce each chunk, then scale) or "tile" (dequantize each weight in registers
    into an elementwise accumulator reduced after the loop, as the fp8 loop). fold (fp8 fma
    loop): products of `fold` adjacent columns summed in the thread before accumulating (an
    accumulator of BLOCK_K / fold columns: fewer registers, more programs resident)."""

    use_dot: bool
    block_n: int
    block_k: int
    num_warps: int
    unroll: int = 1
    num_stages: int = 1
    split_k: int | None = None
    convert: str = "bits"
    unpack: str = "interleave"
    w_evict: str = "evict_first"
    accumulate: str = "chunk"
    fold: int = 1

    def describe(self) -> str:
        loop = "dot" if self.use_dot else "fma"
        split = "auto" if self.split_k is None else self.split_k
        return (f"{loop} BN{self.block_n} BK{self.block_k} u{self.unroll} w{self.num_warps} "
                f"s{self.num_stages} split{split} {self.convert} {self.unpack} "
                f"{self.w_evict or 'no-evict'} {self.accumulate} fold{self.fold}")  # fmt: skip


def _fma(bn: int, bk: int, warps: int, unroll: int = 1) -> QuantGemvConfig:
    return QuantGemvConfig(False, bn, bk, warps, unroll)


def _dot(bn: int, bk: int, warps: int, stages: int) -> QuantGemvConfig:
    return QuantGemvConfig(True, bn, bk, warps, 1, stages)


# M buckets (the first whose bound >= M applies) -> config, per scheme: per bucket the config
# with the least time summed over Llama-3.1-8B's four projections in the last H200 sweep
# (scripts/results/session7/call1_quant_sweep.md), so that other shapes and GPUs start from
# the winning family. M = 1: the fma loops (fp8: 4 channels, 1024-column chunks, 16 adjacent
# products folded; int4: 32 channels, each weight dequantized into an elementwise "tile"
# accumulator); M >= 4: the tensor-core loop (int4 left packed in "planes" at M = 4). int8
# keeps the tensor-core loop everywhere (within 2 % of each shape's best).
_DOT64 = _dot(64, 128, 4, 3)
QUANT_GEMV_DEFAULTS: dict[str, tuple[tuple[int, QuantGemvConfig], ...]] = {
    "fp8": (
        (1, replace(_fma(4, 1024, 2), convert="cvt", fold=16)),
        (4, _dot(32, 128, 4, 4)),
        (16, _dot(32, 256, 4, 3)),
    ),
    "int8": ((1, _DOT64), (4, _DOT64), (16, _DOT64)),
    "int4": (
        (1, replace(_fma(32, 128, 4, 2), convert="cvt", accumulate="tile")),
        (4, replace(_DOT64, unpack="planes")),
        (16, _DOT64),
    ),
}
# (SM count, scheme, M bucket, N, K) -> the fastest config of scripts/gpu/sweep_quant_gemv.py
# (its literal in session7/call1_quant_sweep.md; µs: that sweep's default -> this config).
QUANT_GEMV_TUNED: dict[tuple[int, str, int, int, int], QuantGemvConfig] = {
    # fp8 qkv 6144x4096 M=1: 11.3 -> 9.6 µs
    (132, "fp8", 1, 6144, 4096): QuantGemvConfig(False, 4, 1024, 2, convert="cvt", fold=16),
    # int8 qkv 6144x4096 M=1: 22.5 -> 21.6 µs
    (132, "int8", 1, 6144, 4096): QuantGemvConfig(True, 64, 128, 4, num_stages=3, split_k=4),
    # int4 qkv 6144x4096 M=1: 33.4 -> 16.7 µs
    (132, "int4", 1, 6144, 4096): QuantGemvConfig(False, 32, 128, 4, unroll=4, accumulate="tile"),
    # fp8 o_proj 4096x4096 M=1: 7.8 -> 7.5 µs
    (132, "fp8", 1, 4096, 4096): QuantGemvConfig(False, 4, 2048, 4, convert="cvt", fold=16),
    # int8 o_proj 4096x4096 M=1: 16.6 -> 16.5 µs
    (132, "int8", 1, 4096, 4096): QuantGemvConfig(True, 64, 128, 4, num_stages=3),
    # int4 o_proj 4096x4096 M=1: 24.4 -> 12.6 µs
    (132, "int4", 1, 4096, 4096): QuantGemvConfig(
        False, 32, 128, 4, unroll=2, convert="cvt", accumulate="tile"
    ),
    # fp8 gate_up 28672x4096 M=1: 36.0 -> 31.8 µs
    (132, "fp8", 1, 28672, 4096): QuantGemvConfig(False, 4, 1024, 2, convert="cvt", fold=16),
    # int8 gate_up 28672x4096 M=1: 85.6 -> 72.9 µs
    (132, "int8", 1, 28672, 4096): QuantGemvConfig(False, 32, 128, 1, unroll=2),
    # int4 gate_up 28672x4096 M=1: 128.4 -> 53.3 µs
    (132, "int4", 1, 28672, 4096): QuantGemvConfig(False, 16, 128, 4, unroll=2, accumulate="tile"),
    # fp8 down 4096x14336 M=1: 18.2 -> 17.3 µs
    (132, "fp8", 1, 4096, 14336): QuantGemvConfig(False, 4, 2048, 4, convert="cvt", fold=16),
    # int8 down 4096x14336 M=1: 42.4 -> 42.0 µs
    (132, "int8", 1, 4096, 14336): QuantGemvConfig(True, 128, 128, 8, num_stages=3),
    # int4 down 4096x14336 M=1: 72.1 -> 30.3 µs
    (132, "int4", 1, 4096, 14336): QuantGemvConfig(
        False, 32, 128, 4, unroll=2, convert="cvt", accumulate="tile"
    ),
    # fp8 qkv 6144x4096 M=4: 14.3 -> 14.2 µs
    (132, "fp8", 4, 6144, 4096): QuantGemvConfig(True, 64, 128, 4, num_stages=3),
    # int8 qkv 6144x4096 M=4: 22.6 -> 22.4 µs
    (132, "int8", 4, 6144, 4096): QuantGemvConfig(True, 64, 128, 4, num_stages=4),
    # int4 qkv 6144x4096 M=4: 31.6 -> 24.7 µs
    (132, "int4", 4, 6144, 4096): QuantGemvConfig(True, 64, 128, 4, num_stages=3, unpack="planes"),
    # fp8 o_proj 4096x4096 M=4: 11.7 -> 11.4 µs
    (132, "fp8", 4, 4096, 4096): QuantGemvConfig(True, 32, 128, 4, num_stages=4),
    # int4 o_proj 4096x4096 M=4: 24.3 -> 17.5 µs
    (132, "int4", 4, 4096, 4096): QuantGemvConfig(True, 64, 128, 4, num_stages=3, unpack="planes"),
    # fp8 gate_up 28672x4096 M=4: 49.4 -> 43.2 µs
    (132, "fp8", 4, 28672, 4096): QuantGemvConfig(True, 32, 128, 4, num_stages=4),
    # int8 gate_up 28672x4096 M=4: 86.4 -> 85.7 µs
    (132, "int8", 4, 28672, 4096): QuantGemvConfig(True, 128, 128, 8, num_stages=3),
    # int4 gate_up 28672x4096 M=4: 128.6 -> 93.9 µs
    (132, "int4", 4, 28672, 4096): QuantGemvConfig(True, 64, 128, 4, num_stages=3, unpack="planes"),
    # fp8 down 4096x14336 M=4: 26.3 -> 26.3 µs
    (132, "fp8", 4, 4096, 14336): QuantGemvConfig(True, 64, 128, 4, num_stages=3),
    # int4 down 4096x14336 M=4: 70.8 -> 46.8 µs
    (132, "int4", 4, 4096, 14336): QuantGemvConfig(True, 64, 128, 4, num_stages=3, unpack="planes"),
    # fp8 qkv 6144x4096 M=16: 14.7 -> 14.3 µs
    (132, "fp8", 16, 6144, 4096): QuantGemvConfig(True, 32, 256, 4, num_stages=3),
    # int8 qkv 6144x4096 M=16: 22.7 -> 22.6 µs
    (132, "int8", 16, 6144, 4096): QuantGemvConfig(True, 64, 128, 4, num_stages=3),
    # int4 qkv 6144x4096 M=16: 31.8 -> 31.4 µs
    (132, "int4", 16, 6144, 4096): QuantGemvConfig(True, 128, 128, 8, num_stages=3),
    # fp8 o_proj 4096x4096 M=16: 12.0 -> 11.1 µs
    (132, "fp8", 16, 4096, 4096): QuantGemvConfig(True, 32, 256, 4, num_stages=3),
    # int4 o_proj 4096x4096 M=16: 24.6 -> 23.7 µs
    (132, "int4", 16, 4096, 4096): QuantGemvConfig(True, 128, 128, 8, num_stages=3),
    # fp8 gate_up 28672x4096 M=16: 49.4 -> 43.1 µs
    (132, "fp8", 16, 28672, 4096): QuantGemvConfig(True, 32, 256, 4, num_stages=3),
    # int8 gate_up 28672x4096 M=16: 84.6 -> 84.4 µs
    (132, "int8", 16, 28672, 4096): QuantGemvConfig(True, 64, 128, 4, num_stages=3),
    # int4 gate_up 28672x4096 M=16: 127.7 -> 127.3 µs
    (132, "int4", 16, 28672, 4096): QuantGemvConfig(True, 64, 128, 4, num_stages=3),
    # fp8 down 4096x14336 M=16: 26.9 -> 25.7 µs
    (132, "fp8", 16, 4096, 14336): QuantGemvConfig(True, 32, 256, 4, num_stages=3),
    # int4 down 4096x14336 M=16: 71.2 -> 66.5 µs
    (132, "int4", 16, 4096, 14336): QuantGemvConfig(True, 128, 128, 8, num_stages=3),
}
QUANT_PROGRAMS_PER_SM = 4
QUANT_MAX_SPLIT_K = 16
_COUNTER_SLOTS = 4096  # triton_gemv's per-device arrival counters


@dataclass(frozen=True)
class QuantGemvPlan:
    """One launch: a (tiles, split_k) grid; program (t, s) covers W rows [t * block_n,
    (t + 1) * block_n) and K [s * k_per_split, (s + 1) * k_per_split)."""

    config: QuantGemvConfig
    block_m: int
    tiles: int
    split_k: int
    k_per_split: int

    @property
    def programs(self) -> int:
        return self.tiles * self.split_k


def m_bucket(kind: str, m: int) -> int:
    """The QUANT_GEMV_DEFAULTS bucket (its largest M) of an M-row product."""
    _check(kind in QUANT_KINDS, f"scheme {kind!r} not in {QUANT_KINDS}")
    _check(1 <= m <= WQ_GEMV_MAX_ROWS, f"{m} rows: at most {WQ_GEMV_MAX_ROWS}")
    return next(bound for bound, _ in QUANT_GEMV_DEFAULTS[kind] if m <= bound)


def plan_quant_gemv(
    kind: str, m: int, n: int, k: int, group_size: int, num_sms: int,
    config: QuantGemvConfig | None = None,
) -> QuantGemvPlan:  # fmt: skip
    """The launch of an M-row product with a [n, k] weight of `kind` (group_size: the integer
    schemes' group, k for fp8): `config`, else QUANT_GEMV_TUNED's, else the bucket's default;
    blocks clamped to the problem, the K split automatic unless the config fixes it."""
    bucket = m_bucket(kind, m)
    _check(config is None or kind != "fp8" or config.convert != "half",
           "convert 'half' is for integer codes")  # fmt: skip
    if config is None:
        default = dict(QUANT_GEMV_DEFAULTS[kind])[bucket]
        config = QUANT_GEMV_TUNED.get((num_sms, kind, bucket, n, k), default)
    _check_config_once(config)
    floor = 16 if config.use_dot else 1
    block_n = max(floor, min(config.block_n, triton.next_power_of_2(n)))
    block_k = max(16, min(config.block_k, triton.next_power_of_2(k)))
    if kind != "fp8" and group_size < k:
        while group_size % block_k:
            block_k //= 2
        _check(block_k >= 16, f"group size {group_size} needs chunks of >= 16 columns")
    unpack = config.unpack if kind == "int4" else "interleave"  # only int4 codes are packed
    if unpack == "planes" and config.use_dot and block_k < 128:
        unpack = "interleave"  # a plane's tl.dot needs a depth of >= 16 words
    config = replace(config, block_n=block_n, block_k=block_k, unpack=unpack)
    tiles, step = triton.cdiv(n, block_n), block_k * config.unroll
    steps = triton.cdiv(k, step)
    split_k = config.split_k
    if split_k is None:
        split_k = max(1, min(QUANT_PROGRAMS_PER_SM * num_sms // tiles, QUANT_MAX_SPLIT_K))
    if tiles > _COUNTER_SLOTS:
        split_k = 1
    k_per_split = triton.cdiv(steps, min(split_k, steps)) * step
    block_m = 16 if config.use_dot else triton.next_power_of_2(m)
    return QuantGemvPlan(config, block_m, tiles, triton.cdiv(k, k_per_split), k_per_split)


def check_quant_gemv_config(config: QuantGemvConfig) -> None:
    """ValueError unless the config is launchable."""
    for name in ("block_n", "block_k", "num_warps", "unroll", "fold"):
        value = getattr(config, name)
        _check(value >= 1 and value & (value - 1) == 0, f"{name} must be a power of 2: {config}")
    _check(config.unroll <= 4 and (config.unroll == 1 or not config.use_dot),
           f"unroll: 1, 2 or 4, and 1 with dot: {config}")  # fmt: skip
    _check(config.num_warps <= 16 and config.num_stages >= 1, f"bad warps / stages: {config}")
    _check(config.split_k is None or config.split_k >= 1, f"split_k must be >= 1: {config}")
    _check(config.convert in ("bits", "cvt", "half"), f"convert: bits / cvt / half: {config}")
    _check(config.convert != "half" or not config.use_dot, f"'half': fma loops only: {config}")
    _check(config.unpack in ("interleave", "reshape", "planes"),
           f"unpack: interleave / reshape / planes: {config}")  # fmt: skip
    _check(config.w_evict in ("", "evict_first"), f"w_evict: '' or 'evict_first': {config}")
    _check(config.accumulate in ("chunk", "tile"), f"accumulate: chunk / tile: {config}")


_check_config_once = functools.cache(check_quant_gemv_config)


# --------------------------------------------------------------------------- weight values


@triton.jit
def _unpack_int4(words, UNPACK: tl.constexpr):
    """words [R, W] int32 -> codes [R, 8 W] int32, code j = nibble j % 8 (bits 4 (j % 8)) of
    word j // 8, unpacked in registers."""
    rows: tl.constexpr = words.shape[0]
    width: tl.constexpr = words.shape[1]
    if UNPACK == "interleave":
        spread = tl.interleave(words, words)
        spread = tl.interleave(spread, spread)
        spread = tl.interleave(spread, spread)
        shifts = (tl.arange(0, 8 * width) % 8) * 4
        codes = (spread >> shifts[None, :]) & 0xF
    else:
        nibbles = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
        codes = tl.reshape(nibbles, (rows, 8 * width))
    return codes


@triton.jit
def _codes_to_float(codes, CONVERT: tl.constexpr):
    """int32 codes 0..255 -> exact fp32 values: q ("bits" builds 2^23 + q from its bits and
    subtracts 2^23, no conversion instruction; "cvt" converts), or HALF_OFFSET + q ("half":
    0x6400 | q are the fp16 bits of 1024 + q, widened; the offset is left in, see
    _int_chunk)."""
    if CONVERT == "bits":
        return (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    elif CONVERT == "half":
        return _half_bits_to_float(codes | 0x6400)
    else:
        return codes.to(tl.float32)


@triton.jit
def _half_bits_to_float(bits):
    """int32 holding fp16 bits in its low 16 -> that fp16 value in fp32."""
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _codes_to_operand(codes, DTYPE: tl.constexpr, DOT_OFFSET: tl.constexpr,
                      UPCAST: tl.constexpr):  # fmt: skip
    """int32 codes -> tl.dot operands of DTYPE: q exactly (DOT_OFFSET 0; fp32 for UPCAST, as
    the CPU interpreter converts ints to bf16 wrongly), or DOT_OFFSET + q from bits (bf16:
    0x4300 | q = 128 + q, q < 128; fp16: 0x6400 | q = 1024 + q)."""
    if DOT_OFFSET == 128.0:
        return (codes | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif DOT_OFFSET == 1024.0:
        return (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    elif UPCAST:
        return codes.to(tl.float32)
    else:
        return codes.to(DTYPE)


@triton.jit
def _fp8_to_float(bits, CONVERT: tl.constexpr):
    """float8_e4m3fn bits (uint8) -> fp32: the value ("cvt"), or the value * 2^-8 ("bits":
    sign to bit 15, exponent and mantissa to bits 7..13 of an fp16, whose exponent bias is 8
    above e4m3's; subnormals map to fp16 subnormals, so every value is exact)."""
    if CONVERT == "bits":
        v = bits.to(tl.int32)
        half = ((v & 0x80) << 8) | ((v & 0x7F) << 7)
        return half.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _load_codes(w_ptrs, col, limit, KIND: tl.constexpr, UNPACK: tl.constexpr,
                EVEN_K: tl.constexpr, W_EVICT: tl.constexpr):  # fmt: skip
    """The weight chunk at w_ptrs [R, C] (columns col of the row's storage units, < limit):
    int32 codes [R, C] (int8), [R, 8 C] (int4), or the fp8 bits [R, C] (fp8)."""
    if EVEN_K:
        raw = tl.load(w_ptrs, eviction_policy=W_EVICT)
    else:
        raw = tl.load(w_ptrs, mask=(col < limit)[None, :], other=0, eviction_policy=W_EVICT)
    if KIND == "int4" and UNPACK != "planes":
        return _unpack_int4(raw, UNPACK)
    elif KIND == "int8":
        return raw.to(tl.int32)
    else:
        return raw


@triton.jit
def _dot(x, w, acc, UPCAST: tl.constexpr):
    """acc + x @ w^T in fp32 (UPCAST, the CPU interpreter: operands through fp32, exact)."""
    if UPCAST:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    elif x.dtype == tl.float32:
        return tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    else:
        return tl.dot(x, tl.trans(w), acc)


# --------------------------------------------------------------------------- main loops


@triton.jit
def _fp8_fma_mainloop(x_ptrs, w_ptrs, k_start, k_end, M, K, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
                      EVEN_K: tl.constexpr, CONVERT: tl.constexpr, FOLD: tl.constexpr,
                      W_EVICT: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """sum over the K range of x[m, k] * Wq[n, k] in fp32 -> [BLOCK_M, BLOCK_N] (times 2^-8
    with "bits"), accumulated elementwise in a [BLOCK_M, BLOCK_N, BLOCK_K / FOLD] tile (FOLD
    adjacent products summed first) and reduced once after the loop; x [BLOCK_M, 1, BLOCK_K]
    and W [1, BLOCK_N, BLOCK_K] load straight into the accumulator's layout (triton_gemv's
    fma loop). await_inputs(PDL) after the first iteration's weight loads."""
    rk = tl.arange(0, BLOCK_K)[None, None, :]
    x_ok = (tl.arange(0, BLOCK_M) < M)[:, None, None]
    x3 = x_ptrs[:, None, :]
    w3 = w_ptrs[None, :, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // FOLD), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K * UNROLL):
        wa = _load_fp8(w3, k + rk, K, EVEN_K, W_EVICT)
        if UNROLL >= 2:
            wb = _load_fp8(w3 + BLOCK_K, k + BLOCK_K + rk, K, EVEN_K, W_EVICT)
        if UNROLL >= 4:
            wc = _load_fp8(w3 + 2 * BLOCK_K, k + 2 * BLOCK_K + rk, K, EVEN_K, W_EVICT)
            wd = _load_fp8(w3 + 3 * BLOCK_K, k + 3 * BLOCK_K + rk, K, EVEN_K, W_EVICT)
        if k == k_start:  # the first weights (constant) are in flight while it waits
            await_inputs(PDL)
        acc += _fold(_load_x(x3, x_ok, k + rk, K, EVEN_K) * _fp8_to_float(wa, CONVERT), FOLD)
        if UNROLL >= 2:
            xb = _load_x(x3 + BLOCK_K, x_ok, k + BLOCK_K + rk, K, EVEN_K)
            acc += _fold(xb * _fp8_to_float(wb, CONVERT), FOLD)
        if UNROLL >= 4:
            xc = _load_x(x3 + 2 * BLOCK_K, x_ok, k + 2 * BLOCK_K + rk, K, EVEN_K)
            acc += _fold(xc * _fp8_to_float(wc, CONVERT), FOLD)
            xd = _load_x(x3 + 3 * BLOCK_K, x_ok, k + 3 * BLOCK_K + rk, K, EVEN_K)
            acc += _fold(xd * _fp8_to_float(wd, CONVERT), FOLD)
        x3 += BLOCK_K * UNROLL
        w3 += BLOCK_K * UNROLL
    return tl.sum(acc, axis=2)


@triton.jit
def _fold(products, FOLD: tl.constexpr):
    """[A, B, C] -> [A, B, C / FOLD]: sums of FOLD adjacent columns (FOLD 1: as is)."""
    if FOLD == 1:
        return products
    else:
        a: tl.constexpr = products.shape[0]
        b: tl.constexpr = products.shape[1]
        c: tl.constexpr = products.shape[2]
        return tl.sum(tl.reshape(products, (a, b, c // FOLD, FOLD)), axis=3)


@triton.jit
def _load_fp8(w_ptrs, cols, K, EVEN_K: tl.constexpr, W_EVICT: tl.constexpr):
    if EVEN_K:
        return tl.load(w_ptrs, eviction_policy=W_EVICT)
    else:
        return tl.load(w_ptrs, mask=cols < K, other=0, eviction_policy=W_EVICT)


@triton.jit
def _load_x(x_ptrs, row_ok, cols, K, EVEN_K: tl.constexpr):
    """x (masked rows and columns read as 0) in fp32."""
    if EVEN_K:
        return tl.load(x_ptrs, mask=row_ok, other=0.0).to(tl.float32)
    else:
        return tl.load(x_ptrs, mask=row_ok & (cols < K), other=0.0).to(tl.float32)


@triton.jit
def _fp8_dot_mainloop(x_ptrs, w_ptrs, k_start, k_end, M, K, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                      UPCAST: tl.constexpr, W_EVICT: tl.constexpr):  # fmt: skip
    """The same sum by tl.dot of x [BLOCK_M = 16, BLOCK_K] and the fp8 values in x's dtype
    (exact), fp32 accumulation; the loads software-pipelined over num_stages."""
    rk = tl.arange(0, BLOCK_K)[None, :]
    x_ok = (tl.arange(0, BLOCK_M) < M)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        bits = _load_fp8(w_ptrs, k + rk, K, EVEN_K, W_EVICT)
        if EVEN_K:
            x = tl.load(x_ptrs, mask=x_ok, other=0.0)
        else:
            x = tl.load(x_ptrs, mask=x_ok & (k + rk < K), other=0.0)
        acc = _dot(x, bits.to(tl.float8e4nv, bitcast=True).to(x.dtype), acc, UPCAST)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _group_update(acc, part, x_sum, s_ptrs, z_ptrs, col, group_size, stride_sg, K,
                  DOT_OFFSET: tl.constexpr):  # fmt: skip
    """acc + s[n, g] * (part[m, n] - (z[n, g] + DOT_OFFSET) * x_sum[m]) for the chunk at
    column col (group g = col // group_size; a chunk past K, whose part and x_sum are 0, reads
    the last group's and adds nothing)."""
    group = tl.minimum(col, K - 1) // group_size
    scale = tl.load(s_ptrs + group * stride_sg).to(tl.float32)
    zero = tl.load(z_ptrs + group * stride_sg).to(tl.float32)
    return acc + (part - x_sum[:, None] * (zero + DOT_OFFSET)[None, :]) * scale[None, :]


@triton.jit
def _int_chunk(acc, codes, x_ptrs, x_ok, col, s_ptrs, z_ptrs, group_size, stride_sg, K,
               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, CONVERT: tl.constexpr,
               UNPACK: tl.constexpr, ACCUMULATE: tl.constexpr):  # fmt: skip
    """acc updated with one chunk of BLOCK_K columns (one group g) on CUDA cores. "chunk":
    acc [BLOCK_M, BLOCK_N] + _group_update of P = sum_k x q (reduced across the chunk);
    "tile": acc [BLOCK_M, BLOCK_N, BLOCK_K] + x[m, k] * (q s - z s)[n, k] elementwise (the
    weight dequantized in registers, no reduction until after the loop; x_ptrs 3-D)."""
    OFFSET: tl.constexpr = HALF_OFFSET if CONVERT == "half" else 0.0
    if UNPACK == "planes" and CONVERT == "half":
        return _int4_half_planes_chunk(acc, codes, x_ptrs, x_ok, col, s_ptrs, z_ptrs,
                                       group_size, stride_sg, K, BLOCK_K, EVEN_K,
                                       ACCUMULATE)  # fmt: skip
    elif UNPACK == "planes":
        return _int4_planes_chunk(acc, codes, x_ptrs, x_ok, col, s_ptrs, z_ptrs, group_size,
                                  stride_sg, K, BLOCK_K, EVEN_K, ACCUMULATE)  # fmt: skip
    q = _codes_to_float(codes, CONVERT)  # q + OFFSET
    if ACCUMULATE == "tile":
        x = _load_x(x_ptrs, x_ok, col + tl.arange(0, BLOCK_K)[None, None, :], K, EVEN_K)
        group = tl.minimum(col, K - 1) // group_size
        scale = tl.load(s_ptrs + group * stride_sg).to(tl.float32)
        zero = tl.load(z_ptrs + group * stride_sg).to(tl.float32)
        w = q * scale[:, None] - ((zero + OFFSET) * scale)[:, None]
        return acc + x * w[None, :, :]
    else:
        x = _load_x(x_ptrs, x_ok, col + tl.arange(0, BLOCK_K)[None, :], K, EVEN_K)
        part = tl.sum(x[:, None, :] * q[None, :, :], axis=2)
        return _group_update(acc, part, tl.sum(x, axis=1), s_ptrs, z_ptrs, col, group_size,
                             stride_sg, K, OFFSET)  # fmt: skip


@triton.jit
def _int4_planes_chunk(acc, words, x_ptrs, x_ok, col, s_ptrs, z_ptrs, group_size, stride_sg,
                       K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                       ACCUMULATE: tl.constexpr):  # fmt: skip
    """_int_chunk for int4 words [BLOCK_N, W = BLOCK_K / 8] left packed: the sum is taken plane
    by plane, plane i pairing nibble i of every word (code 8 j + i) with x[8 j + i] (x_ptrs
    [.., W] at columns 8 j), so no code is moved between lanes. Nibble i sits at bits 4 p of
    the word (p = i; for i >= 5, p = i - 3 of the word shifted right by 12), and (bits & 0xF
    << 4 p) | 2^23's bits, minus 2^23, is q 16^p exactly: x is scaled by 16^-p (exact)."""
    group = tl.minimum(col, K - 1) // group_size
    scale = tl.load(s_ptrs + group * stride_sg).to(tl.float32)
    zero = tl.load(z_ptrs + group * stride_sg).to(tl.float32)
    high = words >> 12
    if ACCUMULATE == "tile":
        cols = col + 8 * tl.arange(0, BLOCK_K // 8)[None, None, :]
        zero_scale = (zero * scale)[:, None]
    else:
        cols = col + 8 * tl.arange(0, BLOCK_K // 8)[None, :]
        part = tl.zeros_like(acc)
        x_sum = tl.sum(part, axis=1)
    for i in tl.static_range(8):  # `inverse` a plain name: the compiler (not the interpreter)
        if i < 5:  # refuses a reassigned tl.constexpr in the unrolled loop
            bits = words & (0xF << (4 * i))
            inverse = 1.0 / (1 << (4 * i))
        else:
            bits = high & (0xF << (4 * (i - 3)))
            inverse = 1.0 / (1 << (4 * (i - 3)))
        q = (bits | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0  # q 16^p
        x = _load_x(x_ptrs + i, x_ok, cols + i, K, EVEN_K)
        if ACCUMULATE == "tile":
            acc += x * (q * (scale * inverse)[:, None] - zero_scale)[None, :, :]
        else:
            part += tl.sum((x * inverse)[:, None, :] * q[None, :, :], axis=2)
            x_sum += tl.sum(x, axis=1)
    if ACCUMULATE == "tile":
        return acc
    else:
        return acc + (part - x_sum[:, None] * zero[None, :]) * scale[None, :]


@triton.jit
def _int4_half_planes_chunk(acc, words, x_ptrs, x_ok, col, s_ptrs, z_ptrs, group_size,
                            stride_sg, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                            ACCUMULATE: tl.constexpr):  # fmt: skip
    """_int4_planes_chunk with two codes a bit operation ("half", the exponent magic number
    of fp16): for p = 0..3, ((word >> 4 p) & 0x000F000F) | 0x64006400 holds the fp16 bits
    of 1024 + q_lo in its low half and of 1024 + q_hi in its high half, q_lo = nibble p
    (code 8 j + p), q_hi = nibble p + 4 (code 8 j + p + 4): no shift per code, no float
    subtraction, no conversion from integer. With O = 1024 and, per group g, v_k = O + q_k:

        sum_k x_k (q_k - z_g) s_g = s_g (sum_k x_k v_k - (z_g + O) sum_k x_k)

    one subtraction folding the zero point and the offset, the scale applied once a group.
    Word j's eight products are summed in its thread (P[m, n, j], X[m, j]); "tile" keeps
    acc[m, n, j] += s (P - (z + O) X) elementwise (reduced after the loop: one FFMA a code
    and two a word), "chunk" reduces over j each chunk. In fp32 the offset costs ~10 of the
    sum's 24 bits (v_k ~ 1024 against q_k - z_g ~ 8): ~2^-13 of |y|, inside the 2^-8 max|y|
    the products are checked to."""
    group = tl.minimum(col, K - 1) // group_size
    scale = tl.load(s_ptrs + group * stride_sg).to(tl.float32)
    zero = tl.load(z_ptrs + group * stride_sg).to(tl.float32)
    if ACCUMULATE == "tile":  # x_ptrs [BLOCK_M, 1, W], as acc
        x_ptrs3, x_ok3 = x_ptrs, x_ok
    else:
        x_ptrs3, x_ok3 = x_ptrs[:, None, :], x_ok[:, :, None]
    cols = col + 8 * tl.arange(0, BLOCK_K // 8)[None, None, :]
    part = tl.zeros((x_ptrs3.shape[0], words.shape[0], words.shape[1]), dtype=tl.float32)
    x_sum = tl.zeros((x_ptrs3.shape[0], 1, words.shape[1]), dtype=tl.float32)
    for p in tl.static_range(4):
        pair = ((words >> (4 * p)) & 0x000F000F) | 0x64006400
        v_lo = _half_bits_to_float(pair)[None, :, :]
        v_hi = _half_bits_to_float(pair >> 16)[None, :, :]
        x_lo = _load_x(x_ptrs3 + p, x_ok3, cols + p, K, EVEN_K)
        x_hi = _load_x(x_ptrs3 + p + 4, x_ok3, cols + p + 4, K, EVEN_K)
        part += x_lo * v_lo  # two separate updates: each one FFMA
        part += x_hi * v_hi
        x_sum += x_lo
        x_sum += x_hi
    offset_zero = (zero + HALF_OFFSET)[None, :, None]
    scaled = (part - x_sum * offset_zero) * scale[None, :, None]
    if ACCUMULATE == "tile":
        return acc + scaled
    else:
        return acc + tl.sum(scaled, axis=2)


@triton.jit
def _int_fma_mainloop(x_ptrs, w_ptrs, s_ptrs, z_ptrs, k_start, k_end, M, K, group_size,
                      stride_sg, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, UNROLL: tl.constexpr, EVEN_K: tl.constexpr,
                      KIND: tl.constexpr, CONVERT: tl.constexpr, UNPACK: tl.constexpr,
                      ACCUMULATE: tl.constexpr, W_EVICT: tl.constexpr,
                      PDL: tl.constexpr):  # fmt: skip
    """sum over the K range of x[m, k] (q[n, k] - z[n, g]) s[n, g] -> [BLOCK_M, BLOCK_N]: the
    UNROLL chunks' weights are loaded first (in flight together), then applied chunk by chunk
    (_int_chunk). w_ptrs: [BLOCK_N, BLOCK_K / codes a storage unit] at k_start.
    await_inputs(PDL) after the first iteration's weight loads."""
    PER_UNIT: tl.constexpr = 8 if KIND == "int4" else 1
    UNITS: tl.constexpr = BLOCK_K // PER_UNIT
    ru = tl.arange(0, UNITS)
    k_units = K // PER_UNIT
    X_COLS: tl.constexpr = BLOCK_K // 8 if UNPACK == "planes" else BLOCK_K
    if ACCUMULATE == "tile":
        x_ptrs = x_ptrs[:, None, :]
        x_ok = (tl.arange(0, BLOCK_M) < M)[:, None, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N, X_COLS), dtype=tl.float32)
    else:
        x_ok = (tl.arange(0, BLOCK_M) < M)[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K * UNROLL):
        u = k // PER_UNIT + ru
        qa = _load_codes(w_ptrs, u, k_units, KIND, UNPACK, EVEN_K, W_EVICT)
        if UNROLL >= 2:
            qb = _load_codes(w_ptrs + UNITS, u + UNITS, k_units, KIND, UNPACK, EVEN_K, W_EVICT)
        if UNROLL >= 4:
            qc = _load_codes(w_ptrs + 2 * UNITS, u + 2 * UNITS, k_units, KIND, UNPACK, EVEN_K,
                             W_EVICT)  # fmt: skip
            qd = _load_codes(w_ptrs + 3 * UNITS, u + 3 * UNITS, k_units, KIND, UNPACK, EVEN_K,
                             W_EVICT)  # fmt: skip
        if k == k_start:  # the first weights (constant) are in flight while it waits
            await_inputs(PDL)
        acc = _int_chunk(acc, qa, x_ptrs, x_ok, k, s_ptrs, z_ptrs, group_size, stride_sg, K,
                         BLOCK_K, EVEN_K, CONVERT, UNPACK, ACCUMULATE)  # fmt: skip
        if UNROLL >= 2:
            acc = _int_chunk(acc, qb, x_ptrs + BLOCK_K, x_ok, k + BLOCK_K, s_ptrs, z_ptrs,
                             group_size, stride_sg, K, BLOCK_K, EVEN_K, CONVERT, UNPACK,
                             ACCUMULATE)  # fmt: skip
        if UNROLL >= 4:
            acc = _int_chunk(acc, qc, x_ptrs + 2 * BLOCK_K, x_ok, k + 2 * BLOCK_K, s_ptrs,
                             z_ptrs, group_size, stride_sg, K, BLOCK_K, EVEN_K, CONVERT,
                             UNPACK, ACCUMULATE)  # fmt: skip
            acc = _int_chunk(acc, qd, x_ptrs + 3 * BLOCK_K, x_ok, k + 3 * BLOCK_K, s_ptrs,
                             z_ptrs, group_size, stride_sg, K, BLOCK_K, EVEN_K, CONVERT,
                             UNPACK, ACCUMULATE)  # fmt: skip
        x_ptrs += BLOCK_K * UNROLL
        w_ptrs += UNITS * UNROLL
    if ACCUMULATE == "tile":
        return tl.sum(acc, axis=2)
    else:
        return acc


@triton.jit
def _int4_planes_dot(part, words, x_ptrs, x_ok, col, K, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, DOT_OFFSET: tl.constexpr,
                     UPCAST: tl.constexpr):  # fmt: skip
    """(part + sum_i x_i @ q_i^T, sum_k x) for int4 words [BLOCK_N, W] left packed: plane i
    (nibble i of each word, codes 8 j + i) against x_i = x[:, 8 j + i] (x_ptrs [16, W] at
    columns 8 j), one tl.dot of depth W a plane; no code moves between lanes."""
    cols = col + 8 * tl.arange(0, BLOCK_K // 8)[None, :]
    x_sum = tl.sum(part, axis=1)
    for i in tl.static_range(8):
        if EVEN_K:
            x = tl.load(x_ptrs + i, mask=x_ok, other=0.0)
        else:
            x = tl.load(x_ptrs + i, mask=x_ok & (cols + i < K), other=0.0)
        codes = (words >> (4 * i)) & 0xF
        part = _dot(x, _codes_to_operand(codes, x.dtype, DOT_OFFSET, UPCAST), part, UPCAST)
        x_sum += tl.sum(x.to(tl.float32), axis=1)
    return part, x_sum


@triton.jit
def _int_dot_mainloop(x_ptrs, w_ptrs, s_ptrs, z_ptrs, k_start, k_end, M, K, group_size,
                      stride_sg, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, KIND: tl.constexpr,
                      UNPACK: tl.constexpr, DOT_OFFSET: tl.constexpr, UPCAST: tl.constexpr,
                      W_EVICT: tl.constexpr):  # fmt: skip
    """The same sum with P of each chunk from tl.dot(x [16, BLOCK_K], codes^T) on tensor
    cores (codes, or DOT_OFFSET + codes, exact in x's dtype)."""
    PER_UNIT: tl.constexpr = 8 if KIND == "int4" else 1
    UNITS: tl.constexpr = BLOCK_K // PER_UNIT
    ru = tl.arange(0, UNITS)
    rk = tl.arange(0, BLOCK_K)[None, :]
    x_ok = (tl.arange(0, BLOCK_M) < M)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        codes = _load_codes(w_ptrs, k // PER_UNIT + ru, K // PER_UNIT, KIND, UNPACK, EVEN_K,
                            W_EVICT)  # fmt: skip
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if UNPACK == "planes":
            part, x_sum = _int4_planes_dot(zero, codes, x_ptrs, x_ok, k, K, BLOCK_K, EVEN_K,
                                           DOT_OFFSET, UPCAST)  # fmt: skip
        else:
            if EVEN_K:
                x = tl.load(x_ptrs, mask=x_ok, other=0.0)
            else:
                x = tl.load(x_ptrs, mask=x_ok & (k + rk < K), other=0.0)
            part = _dot(x, _codes_to_operand(codes, x.dtype, DOT_OFFSET, UPCAST), zero, UPCAST)
            x_sum = tl.sum(x.to(tl.float32), axis=1)
        acc = _group_update(acc, part, x_sum, s_ptrs, z_ptrs, k, group_size, stride_sg, K,
                            DOT_OFFSET)  # fmt: skip
        x_ptrs += BLOCK_K
        w_ptrs += UNITS
    return acc


# --------------------------------------------------------------------------- kernels


@triton.jit
def _quant_gemv_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, partial_ptr,
                       counter_ptr, M, N, K, group_size, stride_xm, stride_wn, stride_sn,
                       stride_sg, stride_om, k_per_split, KIND: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       UNROLL: tl.constexpr, USE_DOT: tl.constexpr, EVEN_K: tl.constexpr,
                       SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, CONVERT: tl.constexpr,
                       UNPACK: tl.constexpr, ACCUMULATE: tl.constexpr, FOLD: tl.constexpr,
                       DOT_OFFSET: tl.constexpr, UPCAST: tl.constexpr,
                       W_EVICT: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Program (t, s): rows n in [t BLOCK_N, (t + 1) BLOCK_N) (those >= N read the clamped row
    N - 1, never stored), K range [s k_per_split, min((s + 1) k_per_split, K)); P_s[m, n] the
    module doc's sum over that range (fp32). S == 1: out = round(P_0 + b); S > 1: P_s to
    partial[s, t], the tile's last program to arrive (counter[t], acq_rel) computes
    round(((P_0 + P_1) + ...) + b) and resets counter[t]. w_ptr: int32 words (int4) or bytes
    (int8 codes, fp8 bits); fp8 scale_ptr [N] per channel, int scale / zero [N, groups].
    PDL: launched as a programmatic dependent (see the module's docstring)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    PER_UNIT: tl.constexpr = 8 if KIND == "int4" else 1
    if UNPACK == "planes":  # int4 left packed: x columns 8 j (+ the plane, see the chunk)
        x_cols = k_start + 8 * tl.arange(0, BLOCK_K // 8)
    else:
        x_cols = k_start + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (rm.to(tl.int64) * stride_xm)[:, None] + x_cols[None, :]
    unit_cols = k_start // PER_UNIT + tl.arange(0, BLOCK_K // PER_UNIT)
    w_ptrs = w_ptr + (rows * stride_wn)[:, None] + unit_cols[None, :]
    if KIND == "fp8":
        if USE_DOT:
            await_inputs(PDL)
            acc = _fp8_dot_mainloop(x_ptrs, w_ptrs, k_start, k_end, M, K, BLOCK_M, BLOCK_N,
                                    BLOCK_K, EVEN_K, UPCAST, W_EVICT)  # fmt: skip
        else:
            acc = _fp8_fma_mainloop(x_ptrs, w_ptrs, k_start, k_end, M, K, BLOCK_M, BLOCK_N,
                                    BLOCK_K, UNROLL, EVEN_K, CONVERT, FOLD, W_EVICT,
                                    PDL)  # fmt: skip
            if CONVERT == "bits":
                acc *= 256.0  # the fp16 bits held the values * 2^-8
        acc *= tl.load(scale_ptr + rows).to(tl.float32)[None, :]
    else:
        s_ptrs, z_ptrs = scale_ptr + rows * stride_sn, zero_ptr + rows * stride_sn
        if USE_DOT:
            await_inputs(PDL)
            acc = _int_dot_mainloop(x_ptrs, w_ptrs, s_ptrs, z_ptrs, k_start, k_end, M, K,
                                    group_size, stride_sg, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                                    KIND, UNPACK, DOT_OFFSET, UPCAST, W_EVICT)  # fmt: skip
        else:
            acc = _int_fma_mainloop(x_ptrs, w_ptrs, s_ptrs, z_ptrs, k_start, k_end, M, K,
                                    group_size, stride_sg, BLOCK_M, BLOCK_N, BLOCK_K, UNROLL,
                                    EVEN_K, KIND, CONVERT, UNPACK, ACCUMULATE,
                                    W_EVICT, PDL)  # fmt: skip
    if SPLIT:
        split_k_finish(acc, out_ptr, bias_ptr, partial_ptr, counter_ptr, rm, rn, M, N,
                       stride_om, BLOCK_M, BLOCK_N, HAS_BIAS)  # fmt: skip
    else:
        _store_tile(out_ptr, bias_ptr, acc, rm, rn, M, N, stride_om, HAS_BIAS)


@triton.jit
def _dequantize_kernel(w_ptr, scale_ptr, zero_ptr, out_ptr, N, K, group_size, stride_wn,
                       stride_sn, stride_sg, KIND: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):  # fmt: skip
    """out[n, k] = (q[n, k] - z[n, g]) * s[n, g], g = k // group_size (BLOCK_K divides it:
    one group a program), computed in fp32; the codes read as wide words / bytes."""
    PER_UNIT: tl.constexpr = 8 if KIND == "int4" else 1
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    rk = k0 + tl.arange(0, BLOCK_K)
    units = k0 // PER_UNIT + tl.arange(0, BLOCK_K // PER_UNIT)
    n_ok = rn < N
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    w_ptrs = w_ptr + (rows * stride_wn)[:, None] + units[None, :]
    codes = _load_codes(w_ptrs, units, K // PER_UNIT, KIND, "interleave", False, "")
    group = tl.minimum(k0, K - 1) // group_size
    scale = tl.load(scale_ptr + rows * stride_sn + group * stride_sg).to(tl.float32)
    zero = tl.load(zero_ptr + rows * stride_sn + group * stride_sg).to(tl.float32)
    out = (codes.to(tl.float32) - zero[:, None]) * scale[:, None]
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], _round(out, dtype).to(dtype),
             mask=n_ok[:, None] & (rk < K)[None, :])  # fmt: skip


@triton.jit
def _quantize_fp8_rows_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    static_scale,
    K,
    stride_xm,
    stride_om,
    FP8_MAX_VALUE: tl.constexpr,
    DYNAMIC: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Row m: scale = amax|x_m| / FP8_MAX (DYNAMIC, at least 1e-12) else static_scale; out_m =
    fp8(clamp(x_m / scale, +-FP8_MAX)) rounded to nearest even; scale_ptr[m] = scale."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    scale = static_scale
    if DYNAMIC:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX_VALUE, 1e-12)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)
        q = _round_fp8(x / scale)
        tl.store(out_ptr + row * stride_om + rk, q.to(out_ptr.dtype.element_ty), mask=rk < K)


# --------------------------------------------------------------------------- launchers


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    _check(x.dtype in _FLOAT_DTYPES, f"x dtype {x.dtype} unsupported")
    _check(x.shape[-1] == k, f"x must be [..., {k}]")
    x2d = x.reshape(-1, k)
    _check(x2d.stride(-1) == 1, "x must be contiguous along K")
    return x2d


def _check_int_weight(weight: IntWeight) -> tuple[int, int]:
    """(N, K) of a well-formed IntWeight (see quant_ref): 4-bit codes int32 [N, K / 8], 8-bit
    uint8 [N, K], rows contiguous; scales and zeros [N, K / group], with the same strides (any:
    row-major, or group-major for coalesced reads of one group's scales)."""
    n, k = weight.shape
    expected = {4: ((n, k // 8), torch.int32), 8: ((n, k), torch.uint8)}.get(weight.bits)
    _check(expected is not None, f"{weight.bits}-bit weights unsupported (4 or 8)")
    assert expected is not None
    _check(tuple(weight.qweight.shape) == expected[0] and weight.qweight.dtype == expected[1],
           f"qweight must be {expected[1]} {expected[0]}")  # fmt: skip
    _check(weight.qweight.stride(-1) == 1, "qweight rows must be contiguous")
    _check(weight.zeros.shape == weight.scales.shape
           and weight.zeros.stride() == weight.scales.stride(),
           "scales and zeros must be [N, groups] with the same strides")  # fmt: skip
    _check(weight.perm is None or weight.perm.shape == (k,), f"perm must be [{k}]")
    return n, k


def int_weight_gemv(
    x: torch.Tensor,
    weight: IntWeight,
    bias: torch.Tensor | None = None,
    *,
    config: QuantGemvConfig | None = None,
    dependent_launch: bool = False,
) -> torch.Tensor:
    """x [..., K] (at most WQ_GEMV_MAX_ROWS rows, contiguous along K) @ W^T (+ bias) for an
    IntWeight (perm applied to x first) -> [..., N] of x's dtype. config: forced launch
    parameters (the sweep's way in), else the tuned / default ones. dependent_launch: as a
    programmatic dependent of the kernel before it (CUDA sm_90; the act-order gather of x is a
    torch kernel before it)."""
    n, k = _check_int_weight(weight)
    if weight.perm is not None:
        x = x.index_select(-1, weight.perm)
    x2d = _rows(x, k)
    return _launch_gemv(x, x2d, weight.qweight, weight.scales, weight.zeros, bias,
                        weight.group_size, _KINDS[weight.bits], config,
                        dependent_launch)  # fmt: skip


def fp8_weight_gemv(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: QuantGemvConfig | None = None,
    dependent_launch: bool = False,
) -> torch.Tensor:
    """x [..., K] (at most WQ_GEMV_MAX_ROWS rows) @ (wq * w_scale[:, None])^T (+ bias): the
    fp8 weight [N, K] dequantized in registers, x not quantized (W8A16) -> [..., N].
    dependent_launch: as int_weight_gemv."""
    n, k = wq.shape
    _check(wq.dtype == FP8_DTYPE and w_scale.shape == (n,) and w_scale.stride(0) == 1,
           "wq fp8 [N, K], w_scale [N] contiguous")  # fmt: skip
    x2d = _rows(x, k)
    return _launch_gemv(x, x2d, wq.view(torch.uint8), w_scale.view(n, 1), w_scale.view(n, 1),
                        bias, k, "fp8", config, dependent_launch)  # fmt: skip


def _launch_gemv(
    x: torch.Tensor,
    x2d: torch.Tensor,
    w: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    kind: str,
    config: QuantGemvConfig | None,
    dependent_launch: bool,
) -> torch.Tensor:
    m, k = x2d.shape
    n = w.shape[0]
    _check(1 <= m <= WQ_GEMV_MAX_ROWS, f"{m} rows: at most {WQ_GEMV_MAX_ROWS}")
    _check(w.stride(-1) == 1 and w.device == x.device, "the weight: rows contiguous, x's device")
    _check(bias is None or bias.shape == (n,), f"bias must be [{n}]")
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    plan = plan_quant_gemv(kind, m, n, k, group_size, _num_sms(x.device), config)
    counters = partials = out
    if plan.split_k > 1:
        counters = _counters(x.device)
        if counters is None:  # first use inside a CUDA graph capture: no split this time
            forced = replace(plan.config, split_k=1)
            plan = plan_quant_gemv(kind, m, n, k, group_size, _num_sms(x.device), forced)
            counters = out
        else:
            shape = (plan.split_k, plan.tiles, plan.block_m, plan.config.block_n)
            partials = torch.empty(shape, dtype=torch.float32, device=x.device)
    c = plan.config
    _quant_gemv_kernel[(plan.tiles, plan.split_k)](
        x2d, w, scales, zeros, bias if bias is not None else out, out, partials, counters,
        m, n, k, group_size, x2d.stride(0), w.stride(0), scales.stride(0), scales.stride(1), n,
        plan.k_per_split, KIND=kind, BLOCK_M=plan.block_m, BLOCK_N=c.block_n,
        BLOCK_K=c.block_k, UNROLL=c.unroll, USE_DOT=c.use_dot,
        EVEN_K=k % (c.block_k * c.unroll) == 0, SPLIT=plan.split_k > 1,
        HAS_BIAS=bias is not None, CONVERT=c.convert, UNPACK=c.unpack,
        ACCUMULATE=c.accumulate, FOLD=min(c.fold, c.block_k),
        DOT_OFFSET=_dot_offset(kind, c, x.dtype),
        UPCAST=x.device.type == "cpu" and x.dtype == torch.bfloat16, W_EVICT=c.w_evict,
        PDL=dependent_launch, launch_pdl=dependent_launch, num_warps=c.num_warps,
        num_stages=c.num_stages,
    )  # fmt: skip
    return out


def _dot_offset(kind: str, config: QuantGemvConfig, dtype: torch.dtype) -> float:
    """OFFSET of the "bits" tl.dot operands (module doc), 0.0 where they are plain codes:
    integer codes, 16-bit x, and codes below 128 for bf16 (int4)."""
    if kind == "fp8" or not config.use_dot or config.convert != "bits":
        return 0.0
    if dtype == torch.bfloat16 and kind != "int4":
        return 0.0
    return _DOT_OFFSETS.get(dtype, 0.0)


def dequantize(weight: IntWeight, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] of `dtype` (columns in perm order, as quant_ref.dequantize_int_weight)."""
    n, k = _check_int_weight(weight)
    out = torch.empty((n, k), dtype=dtype, device=weight.qweight.device)
    block_n, block_k = 32, min(128, triton.next_power_of_2(k))
    while weight.group_size < k and weight.group_size % block_k:
        block_k //= 2
    _check(block_k >= 16, f"group size {weight.group_size} needs chunks of >= 16 columns")
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        weight.qweight, weight.scales, weight.zeros, out, n, k, weight.group_size,
        weight.qweight.stride(0), weight.scales.stride(0), weight.scales.stride(1),
        KIND=_KINDS[weight.bits], BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out


def quantize_fp8_rows(
    x: torch.Tensor, static_scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (xq fp8 [M, K], scale float32 [M, 1]): per row (dynamic) or by the
    static scale (a host float: nothing is read back), as quant_ref.quantize_fp8_rows /
    to_fp8."""
    k = x.shape[-1]
    x2d = _rows(x, k)
    m = x2d.shape[0]
    out = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return out, scale
    _quantize_fp8_rows_kernel[(m,)](
        x2d, out, scale, 1.0 if static_scale is None else static_scale, k,
        x2d.stride(0), k, FP8_MAX_VALUE=FP8_MAX, DYNAMIC=static_scale is None,
        BLOCK_K=min(1024, triton.next_power_of_2(k)),
    )  # fmt: skip
    return out, scale
