"""Integer-weight checkpoint layouts (as published on the Hugging Face hub) -> the engine's
IntWeight (kernels.quant_ref), for a weight W [N out, K in] and groups of G input channels:

  GPTQ (AutoGPTQ, GPTQModel)  qweight [K / f, N] int32: f = 32 / bits codes a word along K,
                              code i of a word at bits * i (input channel f * row + i);
                              qzeros [K / G, N / f] int32, packed the same way along N, holding
                              zero - 1 ("gptq", v1) or zero ("gptq_v2"); scales [K / G, N];
                              g_idx [K]: the group of each input channel (desc_act: not k // G)
  AWQ (GEMM)                  qweight [K, N / 8] int32 packed along N in AWQ's order: the code
                              at bits 4 * i of word j is output channel 8 j + AWQ_ORDER[i];
                              qzeros [K / G, N / 8] the same way; scales [K / G, N]
  compressed-tensors          weight_packed [N, K / f] int32 packed along K (code i of a word
  (pack-quantized)            at bits * i), codes stored as unsigned (value + 2^(bits-1));
                              weight_scale [N, K / G]; weight_zero_point [N / f, K / G] packed
                              along N, the same offset (asymmetric only); weight_g_idx [K]

Every layout means W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)] with unsigned codes q.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.quant_ref import IntWeight, pack_codes
from pagedserve.models.quantization.config import IntScheme, QuantizationError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(
    packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """Codes (int32, 0 .. 2^bits - 1) of int32 words holding 32 / bits codes each along `dim`:
    code i of word j (at bits * i) is element (32 / bits) * j + i of that dim, or
    + order[i] when an order is given."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    words = packed.to(torch.int32).movedim(dim, -1)
    codes = (words[..., None] >> shifts) & ((1 << bits) - 1)  # [..., words, per_word]
    if order is not None:
        codes = codes[..., torch.tensor(order).argsort()]
    codes = codes.reshape(*words.shape[:-1], words.shape[-1] * per_word)
    return codes.movedim(-1, dim)


def int_weight_from_codes(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    scheme: IntScheme,
    group_size: int,
    g_idx: torch.Tensor | None,
    dtype: torch.dtype,
) -> IntWeight:
    """codes [N, K], scales / zeros [N, K / group_size] -> IntWeight; with g_idx (act-order)
    the columns are reordered so that each group's are contiguous (perm)."""
    perm = None
    if g_idx is not None:
        k = codes.shape[1]
        perm = torch.argsort(g_idx.to(torch.int64), stable=True)
        expected = torch.arange(k, device=codes.device) // group_size
        if not torch.equal(g_idx.to(torch.int64)[perm], expected):
            raise QuantizationError(f"g_idx does not give every group {group_size} channels")
        if torch.equal(perm, torch.arange(k, device=codes.device)):
            perm = None
        else:
            codes = codes[:, perm]
    return IntWeight(
        qweight=pack_codes(codes, scheme.bits).contiguous(),
        scales=scales.to(dtype).contiguous(),
        zeros=zeros.to(dtype).contiguous(),
        bits=scheme.bits,
        group_size=group_size,
        perm=perm,
    )


def from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    scheme: IntScheme,
    group_size: int,
    dtype: torch.dtype,
) -> IntWeight:
    codes = unpack_int32(qweight, scheme.bits, dim=0).t()
    zeros = unpack_int32(qzeros, scheme.bits, dim=1)[:, : scales.shape[1]] + scheme.zero_offset
    order = g_idx if scheme.act_order else None
    return int_weight_from_codes(codes, scales.t(), zeros.t(), scheme, group_size, order, dtype)


def from_awq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    scheme: IntScheme,
    group_size: int,
    dtype: torch.dtype,
) -> IntWeight:
    codes = unpack_int32(qweight, 4, dim=1, order=AWQ_ORDER).t()
    zeros = unpack_int32(qzeros, 4, dim=1, order=AWQ_ORDER).t()
    return int_weight_from_codes(codes, scales.t(), zeros, scheme, group_size, None, dtype)


def from_compressed_tensors(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    scheme: IntScheme,
    group_size: int,
    dtype: torch.dtype,
) -> IntWeight:
    n, k = weight_scale.shape[0], weight_scale.shape[1] * group_size
    codes = unpack_int32(weight_packed, scheme.bits, dim=1)[:, :k]
    if weight_zero_point is None:
        zeros = torch.full_like(weight_scale, 2 ** (scheme.bits - 1), dtype=torch.float32)
    else:
        zeros = unpack_int32(weight_zero_point, scheme.bits, dim=0)[:n]
    order = g_idx if scheme.act_order else None
    return int_weight_from_codes(codes, weight_scale, zeros, scheme, group_size, order, dtype)
