"""A mixture-of-experts feed-forward for a step's tokens in three launches, on the tensor cores,
the routing read on the device (so a CUDA graph replays it for any routing).

Math (kernels.moe_ref, the reference): token t routed to experts e_1 .. e_k with weights
w_1 .. w_k gives

    y[t] = sum_j w_j * W2[e_j] (silu(W1[e_j] x[t]) * W3[e_j] x[t])      w13[e] = [W1; W3]

Each (token, slot) pair p = t * k + j is one row of the work. `align_by_expert` (one program)
sorts the pairs by expert and pads each expert's run to a multiple of BLOCK_M (padding entries
hold the pair count, an out-of-range index), so that every block of BLOCK_M sorted entries
belongs to one expert; `block_experts[b]` names it and `num_blocks` counts the blocks in use.
It counts each expert's pairs (a histogram), lays the padded runs out by a prefix sum, and
places each pair at its expert's cursor (an atomic add: the order of the pairs within a run is
arbitrary, which changes no result, as rows are computed independently). The GEMMs' grids
cover the most blocks any routing can need, cdiv(P, BLOCK_M) + min(E, P); programs past
`num_blocks` return at once.

  GEMM 1  g[p] = silu(x[p // k] . W1[e]^T) * (x[p // k] . W3[e]^T)   [BLOCK_M, H] x [H, BLOCK_N]
  GEMM 2  z[p] = w_p * (g[p] . w2[e]^T)                              [BLOCK_M, I] x [I, BLOCK_N]
  y[t] = sum_j z[t * k + j]

so each expert's weights are read once per block of its tokens. GPT-OSS's experts add a bias
to each GEMM's dots (before the activation, and before the routing weight) and clamp the
activation (moe_ref's doc): `biases`, `clamped`. BLOCK_M follows the pairs an
expert gets on average (16 for decode steps, up to 64). Accumulation is float32, z is float32;
float32 models multiply exactly (`ieee`). FP8 experts (W8A16): the weights are read as fp8,
widened to x's dtype for the dot, and each output channel's sum multiplied by its scale.

Int4 experts (W4A16; moe_ref.Int4Experts: codes q packed 8 to an int32 along K, a scale s and
a zero z per output channel and group of G inputs, symmetric schemes with z = 8):

    W[e, n, k] = (q[e, n, k] - z[e, n, k // G]) * s[e, n, k // G]

Each K tile of BLOCK_K columns lies in one group (BLOCK_K divides G, or one group spans K), so
a tile loads BLOCK_K / 8 words a row, unpacks them in registers (code k at bits 4 (k % 8) of
word k // 8), and dequantizes with that group's s and z (float32, rounded once to x's dtype,
as the reference does) before the same tensor-core dot: the weights cross memory as 4 bits.
MXFP4 experts (GPT-OSS; moe_ref.Mxfp4Experts: E2M1 codes, two a byte, the low nibble first,
and one power-of-two scale 2^(s - 127) per 32 columns) cross it as 4 bits too, read as int32
words of 8 codes. The dot's k order is free (any permutation of k applied to both operands
gives the same sum), so a tile of BLOCK_K columns is BLOCK_K / 8 words a row and 8 dots:
dot j multiplies code j of each word (columns k0 + 8 i + j) by those columns of x. A word's 8
codes share one scale. On the GPU the codes become bf16 in registers with bit operations
(_E2M1_PAIRS_ASM, two words at a time): code j's sign moved to bit 15 and its 2-bit exponent
and 1-bit mantissa to bits 8..6 read as the bf16 2^-126 |value| (e = 0, m = 1 is the subnormal
2^-127), then times 2^126 and times the scale, both exact (mul.bf16x2: 3 instructions a code);
Triton's interpreter computes the same values through float32 bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels.moe_ref import ClampedSwiGLU, ExpertWeight, Int4Experts, Mxfp4Experts
from pagedserve.kernels.quant_ref import MXFP4_BLOCK
from pagedserve.kernels.triton_dot import accumulate_dot

__all__ = ["ExpertBlocks", "align_by_expert", "fused_experts", "route"]

_CHUNK = 1024  # pairs (and padded entries) the align program handles at a time
_BLOCKS_CHUNK = 32  # blocks whose expert the align program finds at a time


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_experts, stride_logits,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Token t (program t): p = softmax(logits[t]) in float32; its TOP_K largest, largest
    first (ties: the lower expert), their probabilities divided by their sum if RENORMALIZE."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    inside = e < num_experts
    logits = tl.load(logits_ptr + t * stride_logits + e, mask=inside, other=-float("inf"))
    logits = logits.to(tl.float32)
    exp = tl.exp(logits - tl.max(logits, 0))
    probs = tl.where(inside, exp / tl.sum(exp, 0), -1.0)
    chosen = tl.full([BLOCK_E], -1.0, dtype=tl.float32)  # -1: not chosen
    for _ in tl.static_range(TOP_K):
        best = tl.argmax(probs, 0)
        chosen = tl.where(e == best, tl.max(probs, 0), chosen)
        probs = tl.where(e == best, -1.0, probs)
    total = tl.sum(tl.where(chosen >= 0.0, chosen, 0.0), 0)
    # the chosen ones in order of probability, then expert: their rank among the chosen
    for j in tl.static_range(TOP_K):
        best = tl.argmax(chosen, 0)
        value = tl.max(chosen, 0)
        tl.store(weights_ptr + t * TOP_K + j, value / total if RENORMALIZE else value)
        tl.store(ids_ptr + t * TOP_K + j, best.to(tl.int32))
        chosen = tl.where(e == best, -1.0, chosen)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice for logits [T, E]: (weights [T, top_k] float32, expert ids [T, top_k]
    int32), as softmax (float32), top k, optionally renormalised, in one launch."""
    t, num_experts = logits.shape
    if logits.stride(1) != 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"logits {tuple(logits.shape)} need unit column stride, 1 <= k <= E")
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t:
        _route_kernel[(t,)](
            logits, weights, ids, num_experts, logits.stride(0),
            TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts),
        )  # fmt: skip
    return weights, ids


@dataclass(frozen=True)
class _Tiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int


def _tiles(num_pairs: int, num_experts: int) -> _Tiles:
    """Tiles for a step of num_pairs pairs: BLOCK_M the pairs an expert gets on average,
    rounded up to a power of two in [16, 64] (a decode step's experts get a few rows each)."""
    block_m = min(64, max(16, triton.next_power_of_2(triton.cdiv(num_pairs, num_experts))))
    if block_m == 16:
        return _Tiles(block_m=16, block_n=64, block_k=128, num_warps=4)
    return _Tiles(block_m=block_m, block_n=128, block_k=64, num_warps=8 if block_m == 64 else 4)


@dataclass(frozen=True)
class ExpertBlocks:
    """The pairs sorted by expert in blocks of block_m (module doc): `pairs` [max_blocks *
    block_m] int32 (padding: the pair count), `block_experts` [max_blocks] int32, `num_blocks`
    [1] int32 (the blocks in use)."""

    pairs: torch.Tensor
    block_experts: torch.Tensor
    num_blocks: torch.Tensor
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_experts.shape[0]


@triton.jit
def _align_kernel(
    ids_ptr, pairs_ptr, block_experts_ptr, num_blocks_ptr, cursor_ptr, num_pairs, num_experts,
    max_blocks,
    BINS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BLOCKS_CHUNK: tl.constexpr,
):  # fmt: skip
    """One program: counts[e] = the pairs of expert e; each run padded to BLOCK_M and laid out
    in expert order (ends = prefix sum); block b's expert = the runs ending at or before
    b * BLOCK_M; every entry padding, then pair p stored at its expert's cursor (atomic)."""
    bins = tl.arange(0, BINS)
    counts = tl.zeros([BINS], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        p = start + tl.arange(0, CHUNK)
        expert = tl.load(ids_ptr + p, mask=p < num_pairs, other=num_experts).to(tl.int32)
        counts += tl.histogram(expert, BINS)  # masked lanes fall in bin num_experts (unused)
    counts = tl.where(bins < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + bins, ends - padded)
    tl.store(num_blocks_ptr, tl.sum(padded, 0) // BLOCK_M)
    real = bins < num_experts
    for b0 in range(0, max_blocks, BLOCKS_CHUNK):
        b = b0 + tl.arange(0, BLOCKS_CHUNK)
        before = (ends[None, :] <= (b * BLOCK_M)[:, None]) & real[None, :]
        expert_of_block = tl.minimum(tl.sum(before.to(tl.int32), 1), num_experts - 1)
        tl.store(block_experts_ptr + b, expert_of_block, mask=b < max_blocks)
    for i0 in range(0, max_blocks * BLOCK_M, CHUNK):
        i = i0 + tl.arange(0, CHUNK)
        tl.store(pairs_ptr + i, num_pairs, mask=i < max_blocks * BLOCK_M)
    tl.debug_barrier()  # the cursors and the padding are written before any pair is placed
    for start in range(0, num_pairs, CHUNK):
        p = start + tl.arange(0, CHUNK)
        inside = p < num_pairs
        expert = tl.load(ids_ptr + p, mask=inside, other=0).to(tl.int32)
        slot = tl.atomic_add(cursor_ptr + expert, 1, mask=inside)
        tl.store(pairs_ptr + slot, p, mask=inside)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """The (token, slot) pairs of topk_ids [T, k] (contiguous) sorted by expert, each expert's
    run padded to a multiple of block_m: one launch, no host sync."""
    if not topk_ids.is_contiguous():
        raise ValueError("topk_ids must be contiguous")
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    max_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_experts = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_blocks = torch.empty(1, dtype=torch.int32, device=device)
    bins = triton.next_power_of_2(num_experts + 1)
    cursor = torch.empty(bins, dtype=torch.int32, device=device)
    _align_kernel[(1,)](
        topk_ids, pairs, block_experts, num_blocks, cursor, num_pairs, num_experts, max_blocks,
        BINS=bins, BLOCK_M=block_m, CHUNK=_CHUNK, BLOCKS_CHUNK=_BLOCKS_CHUNK, num_warps=4,
    )  # fmt: skip
    return ExpertBlocks(pairs, block_experts, num_blocks, block_m)


@triton.jit
def _weight_tile(
    w_cols, scale_cols, zero_cols, k0, K, n_inside, group_size,
    WEIGHTS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """The tile w[e, n, k0 : k0 + BLOCK_K]^T, [BLOCK_K, BLOCK_N] of DTYPE (w_cols: row n's
    start; zero past N, and past K for "float" / "fp8"): "float" as stored, "fp8" widened
    (its scale applies after the dot), "int4" the BLOCK_K / 8 words of each row unpacked (code
    k at bits 4 (k % 8) of word k // 8) and dequantized, (q - z) * s in float32 with the
    scale and zero of the one group the tile lies in (scale_cols / zero_cols: row n's).
    ("mxfp4": _mxfp4_step.)"""
    if WEIGHTS == "int4":
        words_k = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        mask = (words_k < K // 8)[:, None] & n_inside[None, :]
        words = tl.load(w_cols + words_k[:, None], mask=mask, other=0)  # [BLOCK_K / 8, BLOCK_N]
        shifts = 4 * tl.arange(0, 8)
        codes = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [BLOCK_K / 8, 8, BLOCK_N]
        codes = tl.reshape(codes, [BLOCK_K, BLOCK_N])
        group = k0 // group_size
        scale = tl.load(scale_cols + group, mask=n_inside, other=0.0).to(tl.float32)
        zero = tl.load(zero_cols + group, mask=n_inside, other=0.0).to(tl.float32)
        return ((codes.to(tl.float32) - zero[None, :]) * scale[None, :]).to(DTYPE)
    k = k0 + tl.arange(0, BLOCK_K)
    mask = (k < K)[:, None] & n_inside[None, :]
    w = tl.load(w_cols + k[:, None], mask=mask, other=0.0)
    return w.to(DTYPE)


def _e2m1_pairs_asm() -> str:
    """PTX for two words (8 E2M1 codes each, code j at bits 4j .. 4j + 3: $8, $9) and their
    scales' bf16 bits (2^(s - 127), packed: $10) -> codes j = 0..7 of both words as bf16 pairs
    ($j: word $8's in the low half, $9's in the high half), each code times its scale.

    prmt gathers codes 0-3 (then 4-7) of both words into the two halves of one register; in a
    half, code q's sign (bit 4q + 3) moves to bit 15 and its exponent and mantissa (bits 4q ..
    4q + 2) to bits 8..6: a bf16 of 2^-126 times the code's value (module doc)."""
    lines = [
        "{",
        ".reg .b32 pair, sign, rest, v, mask_sign, mask_code, two126;",
        "mov.b32 mask_sign, 0x80008000;",
        "mov.b32 mask_code, 0x81C081C0;",
        "mov.b32 two126, 0x7E807E80;",
    ]
    for half, selector in enumerate(("0x5410", "0x7632")):
        lines.append(f"prmt.b32 pair, $8, $9, {selector};")
        for q in range(4):
            to_sign, to_rest = 12 - 4 * q, 6 - 4 * q  # bit shifts left (negative: right)
            shift = "shl" if to_rest > 0 else "shr"
            lines += [
                f"shl.b32 sign, pair, {to_sign};" if to_sign else "mov.b32 sign, pair;",
                f"{shift}.b32 rest, pair, {abs(to_rest)};",
                "lop3.b32 v, sign, rest, mask_sign, 0xE4;",  # (sign & mask) | (rest & ~mask)
                "and.b32 v, v, mask_code;",
                "mul.rn.bf16x2 v, v, two126;",
                f"mul.rn.bf16x2 ${4 * half + q}, v, $10;",
            ]
    lines.append("}")
    return "\n".join(lines)


_E2M1_PAIRS_ASM = tl.constexpr(_e2m1_pairs_asm())


@triton.jit
def _e2m1_codes_asm(words, scale_bits):
    """Codes 0..7 of each word of `words` (int32) times their scale (scale_bits: int16, the
    bf16 bits of 2^(s - 127)), as 8 bf16 tensors of words' shape (_e2m1_pairs_asm)."""
    return tl.inline_asm_elementwise(
        _E2M1_PAIRS_ASM,
        "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r",
        [words, scale_bits],
        dtype=(tl.bfloat16,) * 8,
        is_pure=True,
        pack=2,
    )


@triton.jit
def _e2m1_code(words, scale_exponent, j: tl.constexpr):
    """Code j of each word times 2^scale_exponent in float32, from its bits (the interpreter's
    path): sign to bit 31, exponent and mantissa to bits 24..22, a float32 of 2^-126 times the
    code's value (2^-127, e = 0 and m = 1, a subnormal), then times 2^126."""
    code = (words >> (4 * j)) & 0xF
    bits = ((code & 8) << 28) | ((code & 7) << 22)
    value = bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126
    return value * tl.exp2(scale_exponent)


@triton.jit
def _mxfp4_dots(a_rows, a_valid, w_words, w_scales, k0, K, n_inside, acc,
                BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                UPCAST: tl.constexpr, DECODE_ASM: tl.constexpr):  # fmt: skip
    """acc + x[:, k0 : k0 + BLOCK_K] . W[n, k0 : k0 + BLOCK_K]^T for MXFP4 rows W (module doc):
    w_words row n's int32 words of codes (word i: columns 8 i .. 8 i + 7), w_scales row n's
    scale bytes (one per 32 columns); the tile's BLOCK_K / 8 words a row, 8 dots."""
    i = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    inside = (i < K // 8)[:, None] & n_inside[None, :]
    words = tl.load(w_words + i[:, None], mask=inside, other=0)  # [BLOCK_K / 8, BLOCK_N]
    scales = tl.load(w_scales + (i // 4)[:, None], mask=inside, other=127).to(tl.int32)
    columns = 8 * i
    a_mask = a_valid[:, None] & (columns < K)[None, :]  # (K is a multiple of 32)
    if DECODE_ASM:
        scale_bits = tl.where(scales == 0, 0x40, scales << 7).to(tl.int16)  # 2^-127: subnormal
        codes = _e2m1_codes_asm(words, scale_bits)
        for j in tl.static_range(8):
            a = tl.load(a_rows + (columns + j)[None, :], mask=a_mask, other=0.0)
            acc = accumulate_dot(a, codes[j].to(DTYPE), acc, PRECISION, UPCAST)
    else:
        exponents = (scales - 127).to(tl.float32)
        for j in tl.static_range(8):
            a = tl.load(a_rows + (columns + j)[None, :], mask=a_mask, other=0.0)
            w = _e2m1_code(words, exponents, j).to(DTYPE)
            acc = accumulate_dot(a, w, acc, PRECISION, UPCAST)
    return acc


@triton.jit
def _activation(gate, up, alpha, limit, CLAMPED: tl.constexpr, DTYPE: tl.constexpr):
    """The gated activation of float32 dots, rounded to DTYPE where the reference rounds:
    silu(gate) * up, or CLAMPED (u + 1) * g sigmoid(alpha g) with g = min(gate, limit) and
    u = clamp(up, -limit, limit)."""
    gate = gate.to(DTYPE).to(tl.float32)
    up = up.to(DTYPE).to(tl.float32)
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        glu = (gate * tl.sigmoid(gate * alpha)).to(DTYPE).to(tl.float32)
        return (up + 1.0).to(DTYPE).to(tl.float32) * glu
    silu = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
    return silu * up


@triton.jit
def _expert_gemm_kernel(
    a_ptr, w_ptr, out_ptr, pairs_ptr, block_experts_ptr, num_blocks_ptr, weights_ptr,
    scale_ptr, zero_ptr, bias_ptr, num_pairs, N, K, gate_offset, group_size, stride_a, stride_we,
    stride_wn, stride_out, stride_se, stride_sn, stride_be, alpha, limit,
    PAIRS_PER_ROW: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
    WEIGHTS: tl.constexpr, BIASED: tl.constexpr, CLAMPED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, DECODE_ASM: tl.constexpr,
):  # fmt: skip
    """For the pairs p of sorted block m (expert e) and BLOCK_N outputs n (program (m, j)),
    with a = a[p // PAIRS_PER_ROW]: out[p, n] = a . w[e, n] (times weights[p] if WEIGHTED), or
    if GATED silu(a . w[e, n]) * (a . w[e, gate_offset + n]) (gate rows, then up rows).
    WEIGHTS (_weight_tile): "float"; "fp8", each output channel's dot times its scale
    (scale[e, n], scale[e, gate_offset + n]); "int4", dequantized tile by tile (BLOCK_K
    divides the group size, or one group spans K) from words w[e, n, k // 8] and
    scale / zero[e, n, k // group_size]. BIASED: bias[e, n] (and bias[e, gate_offset + n])
    added to the dots first; CLAMPED: GPT-OSS's activation (moe_ref.ClampedSwiGLU, with alpha
    and limit) instead of silu(gate) * up."""
    m = tl.program_id(0)
    j = tl.program_id(1)
    if m < tl.load(num_blocks_ptr):
        pairs = tl.load(pairs_ptr + m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        rows = (pairs // PAIRS_PER_ROW).to(tl.int64)
        expert = tl.load(block_experts_ptr + m).to(tl.int64)
        n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = n < N
        a_rows = a_ptr + rows[:, None] * stride_a
        w_cols = w_ptr + expert * stride_we + n.to(tl.int64) * stride_wn
        up_cols = w_cols + gate_offset * stride_wn
        scale_cols = scale_ptr + expert * stride_se + n * stride_sn
        zero_cols = zero_ptr + expert * stride_se + n * stride_sn
        up_offset = gate_offset * stride_sn  # the up rows' scales and zeros
        dtype = a_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if WEIGHTS == "mxfp4":
                acc = _mxfp4_dots(a_rows, valid, w_cols, scale_cols, k0, K, inside, acc,
                                  BLOCK_K, dtype, PRECISION, UPCAST, DECODE_ASM)  # fmt: skip
                if GATED:
                    up = _mxfp4_dots(a_rows, valid, up_cols, scale_cols + up_offset, k0, K,
                                     inside, up, BLOCK_K, dtype, PRECISION, UPCAST,
                                     DECODE_ASM)  # fmt: skip
            else:
                k = k0 + tl.arange(0, BLOCK_K)
                a_mask = valid[:, None] & (k < K)[None, :]
                a = tl.load(a_rows + k[None, :], mask=a_mask, other=0.0)
                w = _weight_tile(w_cols, scale_cols, zero_cols, k0, K, inside, group_size,
                                 WEIGHTS, BLOCK_K, BLOCK_N, dtype)  # fmt: skip
                acc = accumulate_dot(a, w, acc, PRECISION, UPCAST)
                if GATED:
                    w_up = _weight_tile(
                        up_cols, scale_cols + up_offset, zero_cols + up_offset, k0, K, inside,
                        group_size, WEIGHTS, BLOCK_K, BLOCK_N, dtype,
                    )  # fmt: skip
                    up = accumulate_dot(a, w_up, up, PRECISION, UPCAST)
        if WEIGHTS == "fp8":
            acc *= tl.load(scale_cols, mask=inside, other=0.0)[None, :]
            if GATED:
                up *= tl.load(scale_cols + up_offset, mask=inside, other=0.0)[None, :]
        if BIASED:
            bias_row = bias_ptr + expert * stride_be
            acc += tl.load(bias_row + n, mask=inside, other=0.0).to(tl.float32)
            if GATED:
                up += tl.load(bias_row + gate_offset + n, mask=inside, other=0.0).to(tl.float32)
        if GATED:
            acc = _activation(acc, up, alpha, limit, CLAMPED, out_ptr.dtype.element_ty)
        if WEIGHTED:
            acc *= tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
        out = out_ptr + pairs[:, None].to(tl.int64) * stride_out + n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & inside[None, :])


@dataclass(frozen=True)
class _WeightOperands:
    """One stacked expert weight as the GEMM kernel reads it (_expert_gemm_kernel's doc):
    `codes` [E, rows, K] (float or fp8) or [E, rows, K / 8] (int4's or mxfp4's int32 words);
    `scales` / `zeros` [E, rows] (fp8) or [E, rows, groups] (int4, mxfp4's scales), None where
    the format has none."""

    codes: torch.Tensor
    scales: torch.Tensor | None
    zeros: torch.Tensor | None
    group_size: int  # int4's (else unused)
    kind: str  # "float", "fp8", "int4" or "mxfp4"


def _operands(w: ExpertWeight, scale: torch.Tensor | None) -> _WeightOperands:
    if isinstance(w, Int4Experts):
        return _WeightOperands(w.qweight, w.scales, w.zeros, w.group_size, "int4")
    if isinstance(w, Mxfp4Experts):  # the codes as int32 words of 8
        return _WeightOperands(w.codes.view(torch.int32), w.scales, None, MXFP4_BLOCK, "mxfp4")
    return _WeightOperands(w, scale, None, 0, "float" if scale is None else "fp8")


def _block_k(operands: _WeightOperands, k: int, tiles: _Tiles) -> int:
    """The K tile: the tiles' own, for mxfp4 at least 128 (its 8 dots of BLOCK_K / 8), or for
    int4 at most the largest power of two dividing the group size (so that a tile lies in one
    group), unless one group spans K."""
    if operands.kind == "mxfp4":
        return max(128, tiles.block_k)
    if operands.kind != "int4" or operands.group_size >= k:
        return tiles.block_k
    group = operands.group_size
    return min(tiles.block_k, group & -group)


def _expert_gemm(
    a: torch.Tensor,
    w: _WeightOperands,
    out: torch.Tensor,
    blocks: ExpertBlocks,
    weights: torch.Tensor | None,
    pairs_per_row: int,
    tiles: _Tiles,
    bias: torch.Tensor | None = None,
    clamped: ClampedSwiGLU | None = None,
) -> None:
    """out [P, N] from a and w (rows [E, rows, K]; module doc): GEMM 1 (no weights) is gated,
    w's rows [gate; up] with N of each; GEMM 2 multiplies by the pairs' weights. bias: [E,
    rows] added to the dots; clamped: GEMM 1's activation (moe_ref.ClampedSwiGLU)."""
    num_pairs, n = out.shape
    k = a.shape[1]
    gated = weights is None
    precision = "ieee" if a.dtype == torch.float32 else "tf32"  # fp32 models: exact products
    upcast = a.device.type == "cpu" and a.dtype != torch.float32  # the interpreter
    grid = (blocks.max_blocks, triton.cdiv(n, tiles.block_n))
    scales = w.scales if w.scales is not None else out
    _expert_gemm_kernel[grid](
        a, w.codes, out, blocks.pairs, blocks.block_experts, blocks.num_blocks,
        weights if weights is not None else out, scales,
        w.zeros if w.zeros is not None else out, bias if bias is not None else out,
        num_pairs, n, k, n, w.group_size, a.stride(0), w.codes.stride(0), w.codes.stride(1),
        out.stride(0), scales.stride(0) if w.scales is not None else 0,
        scales.stride(1) if w.scales is not None else 0,
        bias.stride(0) if bias is not None else 0,
        clamped.alpha if clamped is not None else 0.0,
        clamped.limit if clamped is not None else 0.0,
        PAIRS_PER_ROW=pairs_per_row, GATED=gated, WEIGHTED=weights is not None, WEIGHTS=w.kind,
        BIASED=bias is not None, CLAMPED=clamped is not None,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=_block_k(w, k, tiles),
        PRECISION=precision, UPCAST=upcast, DECODE_ASM=a.device.type != "cpu",
        num_warps=tiles.num_warps,
    )  # fmt: skip


def _check_int4(w: Int4Experts, shape: tuple[int, int, int], name: str) -> None:
    """w stands for [E, N, K] = shape: words [E, N, K / 8] int32, scales and zeros of one
    shape [E, N, K / group], all contiguous; groups a multiple of 16 columns (whole K tiles)
    unless one spans K."""
    experts, n, k = shape
    group = w.group_size
    if (
        w.shape != shape or k % 8 or w.qweight.shape != (experts, n, k // 8)
        or w.qweight.dtype != torch.int32 or w.zeros.shape != w.scales.shape
        or not all(t.is_contiguous() for t in (w.qweight, w.scales, w.zeros))
    ):  # fmt: skip
        raise ValueError(
            f"int4 {name} for {shape}: qweight int32 [E, N, K / 8], scales and zeros "
            "[E, N, K / group], contiguous"
        )
    if group < k and group % 16:
        raise ValueError(f"int4 {name}: groups of {group} columns (a multiple of 16 needed)")


def _check_mxfp4(w: Mxfp4Experts, shape: tuple[int, int, int], name: str) -> None:
    """w stands for [E, N, K] = shape: codes [E, N, K / 2] and scales [E, N, K / 32], uint8,
    contiguous."""
    experts, n, k = shape
    if (
        w.shape != shape or w.codes.shape != (experts, n, k // 2)
        or w.codes.dtype != torch.uint8 or w.scales.dtype != torch.uint8
        or not (w.codes.is_contiguous() and w.scales.is_contiguous())
    ):  # fmt: skip
        raise ValueError(
            f"mxfp4 {name} for {shape}: codes [E, N, K / 2] and scales [E, N, K / 32], uint8, "
            "contiguous"
        )


def _check_weights(
    x: torch.Tensor,
    w13: ExpertWeight,
    w2: ExpertWeight,
    scales: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """The weights' shapes fit x [T, H] (w13 [E, 2I, H], w2 [E, H, I]) and their formats
    agree: both x's dtype, both fp8 with scales, or both int4."""
    num_experts, two_i, h_w13 = w13.shape
    hidden, inter = x.shape[1], two_i // 2
    if h_w13 != hidden or two_i % 2 or tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit x {hidden}")
    if isinstance(w13, Mxfp4Experts) or isinstance(w2, Mxfp4Experts):
        if not (isinstance(w13, Mxfp4Experts) and isinstance(w2, Mxfp4Experts)) or scales:
            raise ValueError("mxfp4 experts: w13 and w2 both Mxfp4Experts, no fp8 scales")
        _check_mxfp4(w13, (num_experts, two_i, hidden), "w13")
        _check_mxfp4(w2, (num_experts, hidden, inter), "w2")
        return
    if isinstance(w13, Int4Experts) or isinstance(w2, Int4Experts):
        if not (isinstance(w13, Int4Experts) and isinstance(w2, Int4Experts)) or scales:
            raise ValueError("int4 experts: w13 and w2 both Int4Experts, no fp8 scales")
        _check_int4(w13, (num_experts, two_i, hidden), "w13")
        _check_int4(w2, (num_experts, hidden, inter), "w2")
        return
    if not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("w13 and w2 must be contiguous")
    weight_dtype = x.dtype if scales is None else torch.float8_e4m3fn
    if w13.dtype != weight_dtype or w2.dtype != weight_dtype:
        raise ValueError(f"w13 and w2 must be {weight_dtype} (x {x.dtype}, scales {scales})")
    if scales is not None and (
        scales[0].shape != (num_experts, two_i) or scales[1].shape != (num_experts, hidden)
        or not all(s.dtype == torch.float32 and s.is_contiguous() for s in scales)
    ):  # fmt: skip
        raise ValueError("scales: float32 [E, 2I] and [E, H], contiguous")


def _check_biases(
    biases: tuple[torch.Tensor | None, torch.Tensor | None],
    w13_shape: tuple[int, int],
    w2_shape: tuple[int, int],
) -> None:
    """Each bias given is [E, rows] of its weight, its rows contiguous."""
    for bias, shape in zip(biases, (w13_shape, w2_shape)):
        if bias is not None and (tuple(bias.shape) != shape or bias.stride(1) != 1):
            raise ValueError(f"expert bias {tuple(bias.shape)}: expected {shape}, rows contiguous")


def fused_experts(
    x: torch.Tensor,
    w13: ExpertWeight,
    w2: ExpertWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    clamped: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """x [T, H] (rows contiguous), w13 [E, 2I, H] and w2 [E, H, I] contiguous in x's dtype,
    topk_weights [T, k] float32 and topk_ids [T, k] int (contiguous) -> y [T, H] in x's dtype
    (module doc). scales: fp8 weights (W8A16): float32 [E, 2I] and [E, H] contiguous, one a
    weight's output channel. Int4 weights (W4A16): w13 and w2 both moe_ref.Int4Experts;
    MXFP4 weights: both moe_ref.Mxfp4Experts.
    biases: b13 [E, 2I] and b2 [E, H] (rows contiguous), either None for none; clamped:
    GPT-OSS's activation instead of SwiGLU (moe_ref's doc)."""
    t, hidden = x.shape
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
        raise ValueError(f"topk ids {tuple(topk_ids.shape)}, weights {tuple(topk_weights.shape)}")
    if x.stride(1) != 1:
        raise ValueError("x needs a unit column stride")
    if topk_weights.dtype != torch.float32:
        raise ValueError("topk_weights must be float32")
    _check_weights(x, w13, w2, scales)
    num_experts, two_i, _ = w13.shape
    _check_biases(biases, (num_experts, two_i), (num_experts, hidden))
    w13_scale, w2_scale = scales if scales is not None else (None, None)
    top_k = topk_ids.shape[1]
    num_pairs = t * top_k
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    if num_pairs == 0:
        return out
    tiles = _tiles(num_pairs, num_experts)
    blocks = align_by_expert(topk_ids.contiguous(), num_experts, tiles.block_m)
    activated = torch.empty(num_pairs, two_i // 2, dtype=x.dtype, device=x.device)
    _expert_gemm(x, _operands(w13, w13_scale), activated, blocks, None, top_k, tiles,
                 biases[0], clamped)  # fmt: skip
    contributions = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    _expert_gemm(activated, _operands(w2, w2_scale), contributions, blocks,
                 topk_weights.reshape(-1), 1, tiles, biases[1])  # fmt: skip
    return torch.sum(contributions.view(t, top_k, hidden), dim=1, out=out)
