"""Triton kernels for the small per-token ops: RMSNorm (optionally fused with the residual add),
rotate-half rotary embedding (per tensor, or fused over q and k with a cos/sin cache lookup),
the attention's q/k step in one launch (optional per-head RMSNorm, then rotary, in place on the
fused qkv output) and SiLU-and-mul.

Numerics follow the pure-torch references in `pagedserve.kernels.ops` step by step: every value
is computed in float32 and rounded to the torch result dtype wherever the reference's torch
expression rounds (`_round`), so results match the reference up to fp32 rounding inside a step
(reduction order, rsqrt/exp). Launch: one program per row (token) for the norms and rotary, a
2-D grid (row, column block) for silu_and_mul.

Programmatic dependent launch (`dependent_launch=True`, sm_90 only: the engine sets it from
LayerConfig.dependent_launch): the kernel is launched so that it may start while the kernel
before it on the stream still runs (CUDA graphs keep this). Every kernel here then calls
`await_inputs` before it reads anything an earlier kernel may write, and writes nothing before
it; what it reads earlier is constant (a norm's weight). `await_inputs` also lets the next such
kernel start its own prologue. csrc/grid_dependency.h states the contract for the CUDA kernels,
which keep the same one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedserve.kernels import ops as reference

__all__ = [
    "await_inputs",
    "apply_rotary",
    "apply_rotary_qk",
    "fused_add_rms_norm",
    "qk_norm_rotary_",
    "KVWrite",
    "reference",
    "rms_norm",
    "silu_and_mul",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HIDDEN = 65536


# --------------------------------------------------------------------------- kernels


@triton.jit
def await_inputs(PDL: tl.constexpr):
    """With PDL (the kernel was launched as a programmatic dependent): wait until the kernel
    before it has completed and its writes are visible (griddepcontrol.wait), then let the
    kernel after it launch (griddepcontrol.launch_dependents). Every program must call it
    before it reads what an earlier kernel writes, and before its first store. Nothing
    without PDL (and nothing in the CPU interpreter, where PDL is never set)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """x (fp32) rounded to DTYPE (nearest even) and back: where the torch reference stores a
    DTYPE value. bf16 rounds with integer ops (Triton's CPU interpreter truncates a bf16 cast;
    the result is then exactly representable, so the final cast is exact on every backend)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _round_fp8(x):
    """x (fp32) saturated to +-448 and rounded to the nearest float8_e4m3fn value (ties to
    even), still fp32: normal values keep 3 mantissa bits (integer ops on the bits), those
    below 2^-6 become multiples of 2^-9 (adding and removing 1.5 * 2^14, whose fp32 spacing is
    2^-9). The final cast to fp8 is then exact on every backend (the CPU interpreter's own
    rounding errs where the mantissa carries into the exponent)."""
    x = tl.clamp(x, -448.0, 448.0)
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = (x + 24576.0) - 24576.0
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    """Row i (N elements): with ADD_RESIDUAL, h = round_x(x + residual) is stored to
    residual_out, else h = x; then out = round_out(w * round_x(h * rsqrt(mean(h^2) + eps))).
    PDL: the weight is read before await_inputs, the rest after."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    await_inputs(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    h = x.to(tl.float32)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        h = _round(h + r.to(tl.float32), x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, h.to(x.dtype), mask=mask)
    variance = tl.sum(h * h, axis=0) / N
    normed = _round(h * tl.rsqrt(variance + eps), x.dtype)
    out_dtype = out_ptr.dtype.element_ty
    out = _round(w * normed, out_dtype).to(out_dtype)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


@triton.jit
def _rotate_half(x1, x2, cos, sin, OUT_DTYPE: tl.constexpr):
    """(x1 cos - x2 sin, x2 cos + x1 sin) on fp32 values, each product and each sum rounded to
    OUT_DTYPE like the torch expression (ops.apply_rotary)."""
    o1 = _round(_round(x1 * cos, OUT_DTYPE) - _round(x2 * sin, OUT_DTYPE), OUT_DTYPE)
    o2 = _round(_round(x2 * cos, OUT_DTYPE) + _round(x1 * sin, OUT_DTYPE), OUT_DTYPE)
    return o1, o2


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    stride_xh,
    stride_oh,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_P: tl.constexpr,
    HALF_P: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    """All heads of one token: x = [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin], each product
    and each sum rounded to OUT_DTYPE like the torch expression (cos, sin: [1, HALF_P] fp32)."""
    heads = tl.arange(0, HEADS_P)[:, None]
    cols = tl.arange(0, HALF_P)[None, :]
    mask = (heads < NUM_HEADS) & (cols < HALF)
    x1_ptrs = x_ptr + heads * stride_xh + cols
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = _rotate_half(x1, x2, cos, sin, OUT_DTYPE)
    o1_ptrs = out_ptr + heads * stride_oh + cols
    tl.store(o1_ptrs, o1.to(OUT_DTYPE), mask=mask)
    tl.store(o1_ptrs + HALF, o2.to(OUT_DTYPE), mask=mask)


@triton.jit
def _rotary_kernel(
    x_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_ct,
    stride_st,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_P: tl.constexpr,
    HALF_P: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
):
    """Token t: cos/sin row = positions[t] if HAS_POSITIONS (a cos/sin cache) else t."""
    token = tl.program_id(0).to(tl.int64)
    row = token
    if HAS_POSITIONS:
        row = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, HALF_P)[None, :]
    cos = tl.load(cos_ptr + row * stride_ct + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + row * stride_st + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    _rotate_heads(
        x_ptr + token * stride_xt, out_ptr + token * stride_ot, stride_xh, stride_oh, cos, sin,
        NUM_HEADS, HALF, HEADS_P, HALF_P, OUT_DTYPE,
    )  # fmt: skip


@triton.jit
def _qk_norm_rotary_kernel(
    qk_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    stride_t,
    stride_h,
    stride_p,
    stride_c,
    stride_s,
    eps,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_vcb,
    stride_vco,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    HEADS_P: tl.constexpr,
    HALF_P: tl.constexpr,
    PASS_P: tl.constexpr,
    HEAD_P: tl.constexpr,
    DTYPE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    WRITE_KV: tl.constexpr,
    KV_HEADS_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Token t, in place on its NUM_HEADS heads x = [x1, x2, xp]: the rotated halves x1, x2 of
    HALF dims each, then PASS dims that rotary leaves alone (partial rotary; usually none);
    round = to DTYPE (qk's dtype), as ops.qk_norm_rotary:
      HAS_NORM, per head: h = x in fp32, y = round(h * rsqrt(mean(h^2) + eps)), x = round(w * y)
        with w = q_weight for heads < NUM_Q_HEADS, k_weight for the others;
      rotary, with c = cos_cache[positions[t]], s = sin_cache[positions[t]]:
        [x1, x2] = [round(round(x1 c) - round(x2 s)), round(round(x2 c) + round(x1 s))].
    WRITE_KV (the paged cache's k/v write fused in, as triton_attention.write_kv_cache): with
    slot = slot_mapping[t] >= 0, the k heads (heads >= NUM_Q_HEADS, after the above) go to
    k_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE] and the token's v heads to v_cache there.
    PDL: await_inputs first."""
    token = tl.program_id(0).to(tl.int64)
    await_inputs(PDL)
    position = tl.load(positions_ptr + token * stride_p).to(tl.int64)
    heads = tl.arange(0, HEADS_P)[:, None]
    cols = tl.arange(0, HALF_P)[None, :]
    col_mask = cols < HALF
    mask = (heads < NUM_HEADS) & col_mask
    x1_ptrs = qk_ptr + token * stride_t + heads * stride_h + cols
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    if PASS > 0:
        pass_cols = tl.arange(0, PASS_P)[None, :]
        pass_mask = (heads < NUM_HEADS) & (pass_cols < PASS)
        xp_ptrs = qk_ptr + token * stride_t + heads * stride_h + 2 * HALF + pass_cols
        xp = tl.load(xp_ptrs, mask=pass_mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if PASS > 0:
            squares += tl.sum(xp * xp, axis=1)
        inv_rms = tl.rsqrt(squares / (2 * HALF + PASS) + eps)[:, None]
        is_q = heads < NUM_Q_HEADS
        qw1 = tl.load(q_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        qw2 = tl.load(q_weight_ptr + HALF + cols, mask=col_mask, other=0.0).to(tl.float32)
        kw1 = tl.load(k_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        kw2 = tl.load(k_weight_ptr + HALF + cols, mask=col_mask, other=0.0).to(tl.float32)
        x1 = _round(tl.where(is_q, qw1, kw1) * _round(x1 * inv_rms, DTYPE), DTYPE)
        x2 = _round(tl.where(is_q, qw2, kw2) * _round(x2 * inv_rms, DTYPE), DTYPE)
        if PASS > 0:
            pass_col_mask = pass_cols < PASS
            qwp = tl.load(q_weight_ptr + 2 * HALF + pass_cols, mask=pass_col_mask, other=0.0)
            kwp = tl.load(k_weight_ptr + 2 * HALF + pass_cols, mask=pass_col_mask, other=0.0)
            wp = tl.where(is_q, qwp.to(tl.float32), kwp.to(tl.float32))
            xp = _round(wp * _round(xp * inv_rms, DTYPE), DTYPE)
            tl.store(xp_ptrs, xp.to(DTYPE), mask=pass_mask)
    cos = tl.load(cos_ptr + position * stride_c + cols, mask=col_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * stride_s + cols, mask=col_mask, other=0.0).to(tl.float32)
    o1, o2 = _rotate_half(x1, x2, cos, sin, DTYPE)
    tl.store(x1_ptrs, o1.to(DTYPE), mask=mask)
    tl.store(x1_ptrs + HALF, o2.to(DTYPE), mask=mask)
    if WRITE_KV:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            kv_head = tl.maximum(heads - NUM_Q_HEADS, 0)
            k_ptrs = k_cache_ptr + block * stride_kcb + offset * stride_kco + kv_head * stride_kch
            k_mask = mask & (heads >= NUM_Q_HEADS)
            tl.store(k_ptrs + cols, o1.to(DTYPE), mask=k_mask)
            tl.store(k_ptrs + HALF + cols, o2.to(DTYPE), mask=k_mask)
            if PASS > 0:
                k_pass_mask = pass_mask & (heads >= NUM_Q_HEADS)
                tl.store(k_ptrs + 2 * HALF + pass_cols, xp.to(DTYPE), mask=k_pass_mask)
            v_heads = tl.arange(0, KV_HEADS_P)[:, None]
            v_cols = tl.arange(0, HEAD_P)[None, :]
            v_mask = (v_heads < NUM_HEADS - NUM_Q_HEADS) & (v_cols < 2 * HALF + PASS)
            v = tl.load(v_ptr + token * stride_vt + v_heads * stride_vh + v_cols, mask=v_mask)
            v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vco + v_heads * stride_vch
            tl.store(v_dst + v_cols, v, mask=v_mask)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[i, j] = round(round(silu(gate)) * up) with gate = x[i, j], up = x[i, D + j] and
    silu(g) = g / (1 + exp(-g)) in fp32 (F.silu rounds to the dtype, then the multiply).
    PDL: await_inputs first."""
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + D + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    silu = _round(g / (1.0 + tl.exp(-g)), gate.dtype)
    out = _round(silu * up, gate.dtype).to(gate.dtype)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


# --------------------------------------------------------------------------- launchers


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, dependent_launch: bool = False
) -> torch.Tensor:
    """y = weight * (x / sqrt(mean(x^2, -1) + eps)) (see ops.rms_norm); x: [..., hidden].
    dependent_launch: as a programmatic dependent (CUDA sm_90; see the module's docstring)."""
    x2d = _rows(x, weight)
    out = torch.empty(x.shape, dtype=_result_dtype(x, weight), device=x.device)
    _launch_rms_norm(x2d, None, weight, out.view(x2d.shape), None, eps, dependent_launch)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    inplace: bool = False,
    *,
    dependent_launch: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual; returns (rms_norm(new_residual), new_residual).

    inplace=True writes the norm into x and the new residual into residual (vLLM style; needs
    weight.dtype == x.dtype and row-contiguous x / residual) and returns them.
    dependent_launch: as rms_norm."""
    x2d = _rows(x, weight)
    _check(residual.shape == x.shape and residual.dtype == x.dtype,
           "residual must match x's shape and dtype")  # fmt: skip
    _check(residual.device == x.device, "residual is on another device")
    res2d = residual.reshape(x2d.shape)
    _check(res2d.stride(-1) == 1, "residual must be contiguous in the hidden dim")
    if inplace:
        _check(_result_dtype(x, weight) == x.dtype, "inplace needs weight.dtype == x.dtype")
        _check(x2d.data_ptr() == x.data_ptr() and res2d.data_ptr() == residual.data_ptr(),
               "inplace needs views of x and residual")  # fmt: skip
        _launch_rms_norm(x2d, res2d, weight, x2d, res2d, eps, dependent_launch)
        return x, residual
    out = torch.empty(x.shape, dtype=_result_dtype(x, weight), device=x.device)
    new_residual = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch_rms_norm(x2d, res2d, weight, out.view(x2d.shape), new_residual.view(x2d.shape), eps,
                     dependent_launch)  # fmt: skip
    return out, new_residual


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary (see ops.apply_rotary): x [num_tokens, num_heads, head_dim],
    cos/sin [num_tokens, head_dim // 2]; the result dtype is torch's promotion of x and cos."""
    _check_rotary_input(x, "x")
    half = x.shape[2] // 2
    _check_cos_sin(cos, sin, half, x.device)
    _check(cos.shape[0] == x.shape[0], "cos/sin must be [num_tokens, head_dim // 2]")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    _launch_rotary(x, out, cos, sin, None)
    return out


def apply_rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)) with cos = cos_cache[positions],
    sin = sin_cache[positions], without materialising the gathered rows.

    q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim] (strided
    views of a fused qkv output are fine); positions: [num_tokens] int; caches: [max_pos,
    head_dim // 2]. inplace=True rotates q and k in place (needs the cache dtype == q.dtype)."""
    _check_rotary_input(q, "q")
    _check_rotary_input(k, "k")
    _check(k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2], "q and k shapes disagree")
    _check(k.dtype == q.dtype and k.device == q.device, "q and k dtype/device differ")
    half = q.shape[2] // 2
    _check_cos_sin(cos_cache, sin_cache, half, q.device)
    _check(positions.shape == (q.shape[0],), "positions must be [num_tokens]")
    _check(positions.dtype in (torch.int32, torch.int64), "positions must be int32 or int64")
    _check(positions.device == q.device, "positions is on another device")
    out_dtype = torch.promote_types(q.dtype, cos_cache.dtype)
    if inplace:
        _check(out_dtype == q.dtype, "inplace needs the cos/sin cache in q's dtype")
        q_out, k_out = q, k
    else:
        q_out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=out_dtype, device=q.device)
    _launch_rotary(q, q_out, cos_cache, sin_cache, positions)
    _launch_rotary(k, k_out, cos_cache, sin_cache, positions)
    return q_out, k_out


def qk_norm_rotary_(
    qk: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    num_q_heads: int | None = None,
    kv_write: KVWrite | None = None,
    rotary_dim: int | None = None,
    dependent_launch: bool = False,
) -> torch.Tensor:
    """ops.qk_norm_rotary in place on qk, one launch: optional per-head RMSNorm (q_weight on
    the first num_q_heads heads, k_weight on the rest; Qwen3), then rotary with cos/sin rows
    cos_cache[positions], sin_cache[positions] on the first rotary_dim dims of each head (None:
    all; fewer: partial rotary, Phi-4-mini); with kv_write, also the paged cache write of the
    new k (as rotated) and v heads (what triton_attention.write_kv_cache does). Returns qk.

    qk: [num_tokens, num_q_heads + num_kv_heads, head_dim], typically a strided view of the
    fused qkv projection output (row stride the qkv width, head stride head_dim, last stride
    1); positions: [num_tokens] int; caches: [max_pos, rotary_dim // 2]. Every dtype must promote
    to qk's (the results are stored in place). num_q_heads is needed with the weights or
    kv_write (KVWrite: v [num_tokens, num_kv_heads, head_dim], k/v caches [num_blocks,
    block_size, num_kv_heads, head_dim] of qk's dtype, slot_mapping [num_tokens], < 0 skips).
    dependent_launch: as rms_norm."""
    rotary_dim = qk.shape[-1] if rotary_dim is None else rotary_dim
    _check_qk_norm_rotary(qk, positions, cos_cache, sin_cache, q_weight, k_weight,
                          num_q_heads, kv_write, rotary_dim)  # fmt: skip
    num_tokens, num_heads, head_dim = qk.shape
    half, unrotated = rotary_dim // 2, head_dim - rotary_dim
    has_norm = q_weight is not None
    if num_tokens == 0 or num_heads == 0:
        return qk
    heads_p, half_p = triton.next_power_of_2(num_heads), triton.next_power_of_2(half)
    write = kv_write or KVWrite(qk, qk, qk, positions)  # unused pointers when not writing
    k_cache, v_cache = write.k_cache, write.v_cache
    block_size = k_cache.shape[1] if kv_write is not None else 1
    _qk_norm_rotary_kernel[(num_tokens,)](
        qk, positions, cos_cache, sin_cache,
        q_weight if q_weight is not None else cos_cache,
        k_weight if k_weight is not None else cos_cache,
        qk.stride(0), qk.stride(1), positions.stride(0), cos_cache.stride(0),
        sin_cache.stride(0), eps,
        write.v, k_cache, v_cache, write.slot_mapping, write.v.stride(0), write.v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, NUM_Q_HEADS=num_q_heads if num_q_heads is not None else 0,
        HALF=half, PASS=unrotated, HEADS_P=heads_p, HALF_P=half_p,
        PASS_P=triton.next_power_of_2(max(1, unrotated)),
        HEAD_P=triton.next_power_of_2(head_dim), DTYPE=_TL_DTYPES[qk.dtype],
        HAS_NORM=has_norm, WRITE_KV=kv_write is not None,
        KV_HEADS_P=triton.next_power_of_2(max(1, num_heads - (num_q_heads or 0))),
        BLOCK_SIZE=block_size, PDL=dependent_launch, launch_pdl=dependent_launch,
        num_warps=min(8, max(1, heads_p * half_p // 512)),
    )  # fmt: skip
    return qk


def _check_qk_norm_rotary(
    qk: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    num_q_heads: int | None,
    kv_write: KVWrite | None,
    rotary_dim: int,
) -> None:
    _check_rotary_input(qk, "qk")
    num_tokens, num_heads, head_dim = qk.shape
    _check(num_heads <= 1 or qk.stride(1) == head_dim, "qk's heads must be packed "
           "(head stride head_dim)")  # fmt: skip
    _check(num_tokens <= 1 or qk.stride(0) >= num_heads * head_dim, "qk's token rows overlap")
    _check(0 < rotary_dim <= head_dim and rotary_dim % 2 == 0,
           "rotary_dim must be even, in 2..head_dim")  # fmt: skip
    _check_cos_sin(cos_cache, sin_cache, rotary_dim // 2, qk.device)
    _check(torch.promote_types(qk.dtype, cos_cache.dtype) == qk.dtype,
           "in place needs the cos/sin cache dtype to promote to qk's")  # fmt: skip
    _check(positions.shape == (num_tokens,), "positions must be [num_tokens]")
    _check(positions.dtype in (torch.int32, torch.int64), "positions must be int32 or int64")
    _check(positions.device == qk.device, "positions is on another device")
    has_norm = q_weight is not None or k_weight is not None
    if has_norm:
        _check(q_weight is not None and k_weight is not None, "give both q_weight and k_weight")
        _check(num_q_heads is not None and 0 <= num_q_heads <= num_heads,
               "num_q_heads must be in 0..qk.shape[1] with the norm weights")  # fmt: skip
        for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
            assert weight is not None
            _check(weight.shape == (head_dim,), f"{name} must be [head_dim]")
            _check(weight.dtype in _FLOAT_DTYPES, f"{name} dtype {weight.dtype} unsupported")
            _check(torch.promote_types(qk.dtype, weight.dtype) == qk.dtype,
                   f"in place needs the {name} dtype to promote to qk's")  # fmt: skip
            _check(weight.device == qk.device, f"{name} is on another device")
            _check(weight.is_contiguous(), f"{name} must be contiguous")
    if kv_write is not None:
        _check(num_q_heads is not None and 0 <= num_q_heads < num_heads,
               "num_q_heads must be in 0..qk.shape[1] - 1 with kv_write")  # fmt: skip
        assert num_q_heads is not None
        _check_kv_write(qk, kv_write, num_heads - num_q_heads)


class KVWrite(NamedTuple):
    """Where qk_norm_rotary_ also writes a step's new k/v: the token's v heads, the layer's
    paged caches and each token's cache slot."""

    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor


def _check_kv_write(qk: torch.Tensor, write: KVWrite, num_kv_heads: int) -> None:
    num_tokens, _, head_dim = qk.shape
    v, k_cache, v_cache, slots = write
    _check(v.shape == (num_tokens, num_kv_heads, head_dim), "kv_write.v must be "
           "[num_tokens, num_kv_heads, head_dim]")  # fmt: skip
    _check(v.stride(-1) == 1 and v.dtype == qk.dtype, "kv_write.v: qk's dtype, dim contiguous")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        layout = "[num_blocks, block_size, num_kv_heads, head_dim]"
        _check(cache.dim() == 4 and cache.shape[2:] == (num_kv_heads, head_dim),
               f"kv_write.{name} must be {layout}")  # fmt: skip
        _check(cache.dtype == qk.dtype and cache.stride(-1) == 1,
               f"kv_write.{name}: qk's dtype, dim contiguous")  # fmt: skip
        _check(cache.device == qk.device, f"kv_write.{name} is on another device")
    _check(k_cache.shape == v_cache.shape, "kv_write caches differ in shape")
    _check(slots.shape == (num_tokens,) and slots.device == qk.device,
           "kv_write.slot_mapping must be [num_tokens] on qk's device")  # fmt: skip
    _check(slots.dtype in (torch.int32, torch.int64), "slot_mapping must be int32 or int64")


def silu_and_mul(x: torch.Tensor, *, dependent_launch: bool = False) -> torch.Tensor:
    """x = [gate, up] along the last dim (2 * d); returns silu(gate) * up, [..., d].
    dependent_launch: as rms_norm."""
    _check(x.dtype in _FLOAT_DTYPES, f"dtype {x.dtype} unsupported")
    _check(x.dim() >= 1 and x.shape[-1] % 2 == 0, "last dim must be even ([gate, up])")
    d = x.shape[-1] // 2
    x2d = x.reshape(-1, 2 * d)
    _check(x2d.stride(-1) == 1, "x must be contiguous in the last dim")
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if x2d.shape[0] == 0 or d == 0:
        return out
    block = min(triton.next_power_of_2(d), 1024)
    grid = (x2d.shape[0], triton.cdiv(d, block))
    out2d = out.view(-1, d)
    _silu_and_mul_kernel[grid](
        x2d, out2d, x2d.stride(0), out2d.stride(0), D=d, BLOCK=block,
        PDL=dependent_launch, launch_pdl=dependent_launch, num_warps=4 if block >= 512 else 1,
    )  # fmt: skip
    return out


def _launch_rms_norm(
    x2d: torch.Tensor,
    res2d: torch.Tensor | None,
    weight: torch.Tensor,
    out2d: torch.Tensor,
    res_out2d: torch.Tensor | None,
    eps: float,
    dependent_launch: bool,
) -> None:
    rows, n = x2d.shape
    if rows == 0:
        return
    block = triton.next_power_of_2(n)
    add = res2d is not None
    res = res2d if add else x2d
    res_out = res_out2d if res_out2d is not None else out2d
    _rms_norm_kernel[(rows,)](
        x2d, res, weight, out2d, res_out,
        x2d.stride(0), res.stride(0), out2d.stride(0), res_out.stride(0), eps,
        N=n, BLOCK_N=block, ADD_RESIDUAL=add, PDL=dependent_launch, launch_pdl=dependent_launch,
        num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip


def _launch_rotary(
    x: torch.Tensor,
    out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
) -> None:
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens == 0:
        return
    half = head_dim // 2
    heads_p, half_p = triton.next_power_of_2(num_heads), triton.next_power_of_2(half)
    _rotary_kernel[(num_tokens,)](
        x, out, cos, sin, positions if positions is not None else cos,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), sin.stride(0),
        NUM_HEADS=num_heads, HALF=half, HEADS_P=heads_p, HALF_P=half_p,
        OUT_DTYPE=_TL_DTYPES[out.dtype], HAS_POSITIONS=positions is not None,
        num_warps=4 if heads_p * half_p >= 1024 else 1,
    )  # fmt: skip


# --------------------------------------------------------------------------- checks

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _result_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, weight.dtype)


def _rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x as [rows, hidden] (a view when possible) after checking it against weight."""
    _check(x.dtype in _FLOAT_DTYPES and weight.dtype in _FLOAT_DTYPES, "unsupported dtype")
    _check(x.dim() >= 1 and weight.shape == (x.shape[-1],), "weight must be [hidden]")
    _check(weight.device == x.device, "weight is on another device")
    _check(weight.is_contiguous(), "weight must be contiguous")
    _check(0 < x.shape[-1] <= _MAX_HIDDEN, f"hidden size must be in 1..{_MAX_HIDDEN}")
    x2d = x.reshape(-1, x.shape[-1])
    _check(x2d.stride(-1) == 1, "x must be contiguous in the hidden dim")
    return x2d


def _check_rotary_input(x: torch.Tensor, name: str) -> None:
    _check(x.dim() == 3, f"{name} must be [num_tokens, num_heads, head_dim]")
    _check(x.dtype in _FLOAT_DTYPES, f"{name} dtype {x.dtype} unsupported")
    _check(x.shape[2] % 2 == 0, f"{name} head_dim must be even")
    _check(x.stride(2) == 1, f"{name} must be contiguous in head_dim")


def _check_cos_sin(cos: torch.Tensor, sin: torch.Tensor, half: int, device: torch.device) -> None:
    _check(cos.dim() == 2 and cos.shape[1] == half, "cos/sin last dim must be head_dim // 2 "
           "(rotary_dim // 2 with partial rotary)")  # fmt: skip
    _check(sin.shape == cos.shape and sin.dtype == cos.dtype, "cos and sin must match")
    _check(cos.dtype in _FLOAT_DTYPES, f"cos/sin dtype {cos.dtype} unsupported")
    _check(cos.device == device and sin.device == device, "cos/sin are on another device")
    _check(cos.stride(1) == 1 and sin.stride(1) == 1, "cos/sin must be contiguous in the last dim")
