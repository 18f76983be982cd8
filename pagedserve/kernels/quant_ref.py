"""Pure-torch references of the quantized matmuls and of the quantizers (the CPU path; the
Triton kernels of kernels.triton_quant and torch._scaled_mm are checked against them).

FP8 (E4M3, max 448) W8A8:
    weight   W ~ Wq * sw        Wq [N, K] float8_e4m3fn, sw [N] float32 (per output channel)
    input    x ~ xq * sx        xq [M, K] float8_e4m3fn, sx [M, 1] float32: per token (dynamic,
                                sx = amax|x_m| / 448) or one static scale for every token
    y = (xq * sx) @ (Wq * sw)^T + b, products summed in fp32, rounded once to the output dtype
    (what torch._scaled_mm computes with row-wise scales).

Integer weight-only (W4A16 / W8A16), the engine's layout whatever the checkpoint's:
    codes    q [N, K] unsigned (0 .. 2^bits - 1): 4-bit codes packed 8 to an int32 along K
             (`pack_int4`: code k of a row in word k // 8 at bits 4 (k % 8)), 8-bit codes uint8
    scales   s [N, K / group] and zeros z [N, K / group] (the model's float dtype), group g
             covering columns [g * group, (g + 1) * group); symmetric schemes have z = 2^(bits-1)
    perm     [K] int64 or None (GPTQ act-order): the weight's columns were reordered so that its
             groups are contiguous; the input's columns follow (x[..., perm])
    W[n, k] = (q[n, k] - z[n, k // group]) * s[n, k // group]
    y = x[..., perm] @ W^T + b

MXFP4 (OpenAI's GPT-OSS experts; OCP microscaling), weight-only:
    codes    c [N, K / 2] uint8: E2M1 code k of a row in byte k // 2, the low nibble for even k
             (sign bit 3, exponent bits 2-1, mantissa bit 0: 0, 0.5, 1, 1.5, 2, 3, 4, 6)
    scales   e [N, K / 32] uint8, a power of two per 32 columns (E8M0)
    W[n, k] = e2m1(c[n, k]) * 2^(e[n, k // 32] - 127)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_SCALE = 1e-12  # an all-zero row still divides by something


# --------------------------------------------------------------------------- fp8


def to_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale, saturated to +-448, rounded to float8_e4m3fn (computed in fp32)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (xq fp8 [..., K], scale float32 [..., 1]) with scale = amax|row| / 448:
    per token for activations, per output channel for a weight [N, K]."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_(min=_MIN_SCALE)
    return to_fp8(x, scale), scale


def fp8_scaled_matmul(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(xq * x_scale) @ (wq * w_scale)^T + bias in fp32, rounded once to out_dtype; xq
    [M, K], x_scale [M, 1] (or [1, 1]), wq [N, K], w_scale [N]."""
    x = xq.float() * x_scale.float()
    w = wq.float() * w_scale.float()[:, None]
    return F.linear(x, w, None if bias is None else bias.float()).to(out_dtype)


def fp8_linear(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: float | None = None,
) -> torch.Tensor:
    """The W8A8 layer: x [..., K] quantized per token (dynamic) or by the static input_scale,
    then fp8_scaled_matmul -> [..., N] of x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    if input_scale is None:
        xq, x_scale = quantize_fp8_rows(rows)
    else:
        x_scale = torch.full((1, 1), input_scale, device=x.device)
        xq = to_fp8(rows, x_scale)
    out = fp8_scaled_matmul(xq, x_scale, wq, w_scale, bias, x.dtype)
    return out.reshape(*x.shape[:-1], wq.shape[0])


# --------------------------------------------------------------------------- integer weights


@dataclass
class IntWeight:
    """A weight in the engine's integer layout (see the module doc)."""

    qweight: torch.Tensor  # [N, K // 8] int32 (4-bit) or [N, K] uint8 (8-bit)
    scales: torch.Tensor  # [N, K // group]
    zeros: torch.Tensor  # [N, K // group]
    bits: int
    group_size: int
    perm: torch.Tensor | None = None  # [K] int64

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the weight it stands for."""
        n = self.qweight.shape[0]
        return n, self.scales.shape[1] * self.group_size


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (0..15, K a multiple of 8) -> [N, K // 8] int32, code k in word k // 8 at
    bits 4 * (k % 8)."""
    n, k = codes.shape
    nibbles = codes.to(torch.int64).reshape(n, k // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    words = (nibbles << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same bits


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4's inverse: [N, K // 8] int32 -> [N, K] int32 codes 0..15."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    codes = (packed[..., None] >> shifts) & 0xF
    return codes.reshape(packed.shape[0], -1)


def unpack_codes(weight: IntWeight) -> torch.Tensor:
    """The weight's codes [N, K] as int32."""
    if weight.bits == 4:
        return unpack_int4(weight.qweight)
    return weight.qweight.to(torch.int32)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, K] -> the layout's qweight for `bits` (4: pack_int4, 8: uint8)."""
    if bits == 4:
        return pack_int4(codes)
    if bits == 8:
        return codes.to(torch.uint8)
    raise ValueError(f"{bits}-bit weights are not supported (4 or 8)")


def quantize_int_weight(w: torch.Tensor, bits: int, group_size: int, symmetric: bool) -> IntWeight:
    """Round-to-nearest quantization of w [N, K] (group_size dividing K): symmetric, scale =
    amax|group| / (2^(bits-1) - 1) and zero 2^(bits-1); asymmetric, scale = (max - min) /
    (2^bits - 1) and zero = round(-min / scale), clamped to the code range."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the input size {k}")
    groups = w.float().reshape(n, k // group_size, group_size)
    top = 2**bits - 1
    if symmetric:
        half = 2 ** (bits - 1)
        scales = (groups.abs().amax(dim=-1) / (half - 1)).clamp_(min=_MIN_SCALE)
        zeros = torch.full_like(scales, float(half))
    else:
        low, high = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)
        scales = ((high - low) / top).clamp_(min=_MIN_SCALE)
        zeros = torch.round(-low / scales).clamp_(0, top)
    codes = torch.round(groups / scales[..., None] + zeros[..., None]).clamp_(0, top)
    codes = codes.reshape(n, k).to(torch.int32)
    dtype = w.dtype
    return IntWeight(pack_codes(codes, bits), scales.to(dtype), zeros.to(dtype), bits, group_size)


def dequantize_int_weight(weight: IntWeight, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] = (q - z) * s per group, computed in fp32, of `dtype` (columns in the
    permuted order when weight.perm is set: the order the input is brought into)."""
    codes = unpack_codes(weight).float()
    n, k = codes.shape
    groups = codes.reshape(n, k // weight.group_size, weight.group_size)
    w = (groups - weight.zeros.float()[..., None]) * weight.scales.float()[..., None]
    return w.reshape(n, k).to(dtype)


def int_linear(x: torch.Tensor, weight: IntWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] -> x[..., perm] @ W^T + b: the weight dequantized to x's dtype, F.linear."""
    if weight.perm is not None:
        x = x.index_select(-1, weight.perm)
    return F.linear(x, dequantize_int_weight(weight, x.dtype), bias)


# --------------------------------------------------------------------------- mxfp4

E2M1_VALUES = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip
MXFP4_BLOCK = 32  # columns sharing one scale


def dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., K / 2] and scales [..., K / 32] uint8 (the module doc) -> W [..., K] of
    dtype (exact in bf16 and float32)."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    values = lut[torch.stack([codes & 0x0F, codes >> 4], dim=-1).flatten(-2).long()]
    exponents = scales.to(torch.int32) - 127
    blocks = values.unflatten(-1, (-1, MXFP4_BLOCK))
    return torch.ldexp(blocks, exponents.unsqueeze(-1).float()).flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., K] (K a multiple of 32) -> (codes [..., K / 2], scales [..., K / 32]) uint8: each
    32 columns' scale 2^(floor(log2 amax) - 2) (the OCP rule: the largest code, 6, spans the
    top binade), each value rounded to the nearest E2M1 code (ties to the smaller), values
    past 6 saturated."""
    blocks = w.float().unflatten(-1, (-1, MXFP4_BLOCK))
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(2.0**-126)
    exponents = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    scaled = (blocks / torch.exp2(exponents)).abs()
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=w.device)
    index = torch.bucketize(scaled, midpoints, right=False)  # the nearest magnitude's index
    codes = (index | torch.where(blocks < 0, 8, 0)).flatten(-2).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponents.squeeze(-1) + 127).to(torch.uint8)
