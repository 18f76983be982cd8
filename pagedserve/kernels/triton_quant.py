"""Triton kernels of the quantized linear layers (layouts and references: kernels.quant_ref).

- `_wq_gemv_kernel` (weight-quantized GEMM for skinny batches, M <= WQ_GEMV_MAX_ROWS: decode):
  y = x @ W^T (+ b) with W read in its quantized form and dequantized in registers. A program
  owns BLOCK_N output channels and walks K in BLOCK_K chunks, each inside one quantization
  group (BLOCK_K divides the group size), so per chunk

      int:  acc[m, n] += s[n, g] * sum_k x[m, k] * (q[n, k] - z[n, g])
      fp8:  acc[m, n] += sum_k x[m, k] * Wq[n, k]        (acc *= sw[n] after the loop)

  (q - z) and fp8 values are exact in x's dtype, so the inner sum is one tl.dot of x with
  exact operands, accumulated in fp32; 4-bit codes come from their int32 word (k // 8) shifted
  by 4 (k % 8). The weight bytes are read once: 0.5 byte a weight for int4, 1 for int8/fp8.
- `_dequantize_kernel` (large batches): W [N, K] in x's dtype from the integer layout, for a
  cuBLAS matmul after (a prefill chunk is compute-bound; the dequantized copy is transient).
- `_quantize_fp8_rows_kernel`: activations to fp8 for torch._scaled_mm, per token (scale
  amax|x_m| / 448, two passes over the row) or with one static scale.

Numerics: fp32 accumulation, one rounding of acc (+ bias) to the output dtype (nearest even;
bf16 by integer ops, as triton_ops._round does, because the CPU interpreter truncates casts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.quant_ref import FP8_DTYPE, FP8_MAX, IntWeight
from pagedserve.kernels.triton_ops import _round, _round_fp8

WQ_GEMV_MAX_ROWS = 16
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_KINDS = {4: "int4", 8: "int8"}


@triton.jit
def _load_weight_chunk(
    w_ptr, rn, rk, n_ok, k_ok, stride_wn, KIND: tl.constexpr, DTYPE: tl.constexpr
):
    """The [BLOCK_N, BLOCK_K] weight chunk as exact values of DTYPE: codes (int4 / int8,
    zero point not yet subtracted) or fp8 values (read as bytes: masked ones are +0.0)."""
    mask = n_ok[:, None] & k_ok[None, :]
    offsets = rn[:, None].to(tl.int64) * stride_wn
    if KIND == "int4":
        words = tl.load(w_ptr + offsets + (rk // 8)[None, :], mask=mask, other=0)
        w = (words >> ((rk % 8) * 4)[None, :]) & 0xF
    elif KIND == "fp8":
        byte_ptr = w_ptr.to(tl.pointer_type(tl.uint8))
        bits = tl.load(byte_ptr + offsets + rk[None, :], mask=mask, other=0)
        w = bits.to(tl.float8e4nv, bitcast=True)
    else:
        w = tl.load(w_ptr + offsets + rk[None, :], mask=mask, other=0)
    return w.to(DTYPE)


@triton.jit
def _wq_gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    zero_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    GROUP: tl.constexpr,
    KIND: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """out[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]) for program n's BLOCK_N channels (see the
    module doc); UPCAST (CPU interpreter, bf16): the dot in fp32 (the interpreter multiplies
    bf16 as raw integers)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_ok, m_ok = rn < N, rm < M
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x_mask = m_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=x_mask, other=0.0)
        if KIND == "fp8":
            w = _load_weight_chunk(w_ptr, rn, rk, n_ok, k_ok, stride_wn, KIND, dtype)
        else:  # q - z: small integers, exact in any float dtype (columns past K meet x = 0)
            codes = _load_weight_chunk(w_ptr, rn, rk, n_ok, k_ok, stride_wn, KIND, tl.float32)
            group = k0 // GROUP
            zero = tl.load(zero_ptr + rn * stride_sn + group, mask=n_ok, other=0.0)
            w = (codes - zero.to(tl.float32)[:, None]).to(dtype)
        if UPCAST:
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(x, tl.trans(w), input_precision="ieee" if dtype == tl.float32 else "tf32")
        if KIND == "fp8":
            acc += part
        else:
            scale = tl.load(scale_ptr + rn * stride_sn + group, mask=n_ok, other=0.0)
            acc += part * scale.to(tl.float32)[None, :]
    if KIND == "fp8":
        acc *= tl.load(scale_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = _round(acc, dtype).to(dtype)
    tl.store(
        out_ptr + rm[:, None] * stride_om + rn[None, :], out, mask=m_ok[:, None] & n_ok[None, :]
    )


@triton.jit
def _dequantize_kernel(
    w_ptr,
    scale_ptr,
    zero_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    stride_sn,
    GROUP: tl.constexpr,
    KIND: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[n, k] = (q[n, k] - z[n, g]) * s[n, g], g = k // GROUP, computed in fp32."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok, k_ok = rn < N, rk < K
    mask = n_ok[:, None] & k_ok[None, :]
    codes = _load_weight_chunk(w_ptr, rn, rk, n_ok, k_ok, stride_wn, KIND, tl.float32)
    groups = rn[:, None] * stride_sn + (rk // GROUP)[None, :]
    scale = tl.load(scale_ptr + groups, mask=mask, other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + groups, mask=mask, other=0.0).to(tl.float32)
    out = (codes - zero) * scale
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], _round(out, dtype).to(dtype),
             mask=mask)  # fmt: skip


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
    uint8 [N, K], rows contiguous; scales and zeros [N, K / group], rows alike."""
    n, k = weight.shape
    expected = {4: ((n, k // 8), torch.int32), 8: ((n, k), torch.uint8)}.get(weight.bits)
    _check(expected is not None, f"{weight.bits}-bit weights unsupported (4 or 8)")
    assert expected is not None
    _check(tuple(weight.qweight.shape) == expected[0] and weight.qweight.dtype == expected[1],
           f"qweight must be {expected[1]} {expected[0]}")  # fmt: skip
    _check(weight.qweight.stride(-1) == 1, "qweight rows must be contiguous")
    _check(weight.zeros.shape == weight.scales.shape and weight.scales.stride(1) == 1
           and weight.zeros.stride() == weight.scales.stride(),
           "scales and zeros must be [N, groups], rows alike")  # fmt: skip
    _check(weight.perm is None or weight.perm.shape == (k,), f"perm must be [{k}]")
    return n, k


def _block_k(group_size: int, k: int) -> int:
    """Chunks inside one group: a power of two dividing the group size (per-channel: any)."""
    if group_size >= k:
        return min(128, triton.next_power_of_2(k))
    block = 128
    while group_size % block:
        block //= 2
    _check(block >= 16, f"group size {group_size} needs chunks of >= 16 columns")
    return block


def int_weight_gemv(
    x: torch.Tensor, weight: IntWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] (at most WQ_GEMV_MAX_ROWS rows, contiguous along K) @ W^T (+ bias) for an
    IntWeight (perm applied to x first) -> [..., N] of x's dtype."""
    n, k = _check_int_weight(weight)
    if weight.perm is not None:
        x = x.index_select(-1, weight.perm)
    x2d = _rows(x, k)
    return _launch_gemv(x, x2d, weight.qweight, weight.scales, weight.zeros, bias, n,
                        weight.group_size, _KINDS[weight.bits])  # fmt: skip


def fp8_weight_gemv(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] (at most WQ_GEMV_MAX_ROWS rows) @ (wq * w_scale[:, None])^T (+ bias): the
    fp8 weight [N, K] dequantized in registers, x not quantized (W8A16) -> [..., N]."""
    n, k = wq.shape
    _check(wq.dtype == FP8_DTYPE and w_scale.shape == (n,), "wq fp8 [N, K], w_scale [N]")
    x2d = _rows(x, k)
    return _launch_gemv(x, x2d, wq, w_scale, w_scale, bias, n, k, "fp8")


def _launch_gemv(
    x: torch.Tensor,
    x2d: torch.Tensor,
    w: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bias: torch.Tensor | None,
    n: int,
    group_size: int,
    kind: str,
) -> torch.Tensor:
    m, k = x2d.shape
    _check(1 <= m <= WQ_GEMV_MAX_ROWS, f"{m} rows: at most {WQ_GEMV_MAX_ROWS}")
    _check(w.stride(-1) == 1 and w.device == x.device, "the weight: rows contiguous, x's device")
    _check(bias is None or bias.shape == (n,), f"bias must be [{n}]")
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    block_n = 32 if n >= 2048 or x.device.type == "cpu" else 16
    _wq_gemv_kernel[(triton.cdiv(n, block_n),)](
        x2d, w, scales, zeros, bias if bias is not None else scales, out, m, n, k,
        x2d.stride(0), w.stride(0), scales.stride(0), n,
        GROUP=group_size, KIND=kind, HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=block_n,
        BLOCK_K=_block_k(group_size, k),
        UPCAST=x.device.type == "cpu" and x.dtype == torch.bfloat16,
        num_warps=4, num_stages=3,
    )  # fmt: skip
    return out


def dequantize(weight: IntWeight, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] of `dtype` (columns in perm order, as quant_ref.dequantize_int_weight)."""
    n, k = _check_int_weight(weight)
    out = torch.empty((n, k), dtype=dtype, device=weight.qweight.device)
    block_n, block_k = 32, _block_k(weight.group_size, k)
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        weight.qweight, weight.scales, weight.zeros, out, n, k, weight.qweight.stride(0),
        weight.scales.stride(0), GROUP=weight.group_size, KIND=_KINDS[weight.bits],
        BLOCK_N=block_n, BLOCK_K=block_k,
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
