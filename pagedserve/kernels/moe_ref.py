"""The pure-torch reference of a mixture-of-experts feed-forward (the CPU path's definition;
the Triton kernels of kernels.triton_moe are checked against it).

Math. Token t was routed to experts e_1 .. e_k with weights w_1 .. w_k (the router's top k).
Each expert e is a SwiGLU MLP with w13[e] = [W1; W3] ([2I, H]: gate rows, then up rows) and
w2[e] ([H, I]):

    y[t] = sum_j w_j * W2[e_j] (silu(W1[e_j] x[t]) * W3[e_j] x[t])

GPT-OSS's experts add biases (b13[e] = [b1; b3] to the gate and up rows, b2[e] to the output,
before the routing weight) and clamp their gate (`ClampedSwiGLU`):

    y[t] = sum_j w_j * (W2[e_j] act(W1[e_j] x[t] + b1[e_j], W3[e_j] x[t] + b3[e_j]) + b2[e_j])
    act(g, u) = (clamp(u, -L, L) + 1) * g' * sigmoid(alpha * g'),   g' = min(g, L)

Here expert by expert over the tokens routed to it (as transformers computes it), each expert's
contribution weighted in float32 and summed into a float32 output.

Quantized experts are dequantized into x's dtype where they are used: fp8 weights times their
scale per output channel; int4 weights (`Int4Experts`: kernels.quant_ref's integer layout, one
weight an expert) as W[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G], computed in float32;
MXFP4 weights (`Mxfp4Experts`) as kernels.quant_ref.dequantize_mxfp4 gives them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.kernels.ops import silu_and_mul
from pagedserve.kernels.quant_ref import (
    MXFP4_BLOCK,
    IntWeight,
    dequantize_int_weight,
    dequantize_mxfp4,
)


@dataclass(frozen=True)
class Int4Experts:
    """One stacked expert weight W [E, N, K] of int4 codes, each expert's in quant_ref's
    layout: qweight [E, N, K / 8] int32 (code k of a row at bits 4 (k % 8) of word k // 8),
    scales and zeros [E, N, K / group_size] in the model's dtype."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N, K) of the weight it stands for."""
        experts, n, groups = self.scales.shape
        return experts, n, groups * self.group_size

    def expert(self, index: int) -> IntWeight:
        """Expert `index`'s weight [N, K]."""
        return IntWeight(self.qweight[index], self.scales[index], self.zeros[index], 4,
                         self.group_size)  # fmt: skip


@dataclass(frozen=True)
class Mxfp4Experts:
    """One stacked expert weight W [E, N, K] in MXFP4 (GPT-OSS's experts; kernels.quant_ref's
    layout, one weight an expert): codes [E, N, K / 2] and scales [E, N, K / 32], uint8."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N, K) of the weight it stands for."""
        experts, n, groups = self.scales.shape
        return experts, n, groups * MXFP4_BLOCK


ExpertWeight = torch.Tensor | Int4Experts | Mxfp4Experts


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's gated activation (module doc): the gate capped above at `limit`, the up
    projection clamped to [-limit, limit] and shifted by one, a sigmoid of gain `alpha`."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def gated_activation(gate_up: torch.Tensor, clamped: ClampedSwiGLU | None) -> torch.Tensor:
    """[..., 2I] (gate, then up) -> [..., I]: SwiGLU, or the clamped form."""
    if clamped is None:
        return silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return clamped(gate, up)


def _expert_weight(
    weight: ExpertWeight, scale: torch.Tensor | None, expert: int, dtype: torch.dtype
) -> torch.Tensor:
    """Expert `expert`'s weight [N, K] in dtype (scale: an fp8 weight's, per output channel)."""
    if isinstance(weight, Int4Experts):
        return dequantize_int_weight(weight.expert(expert), dtype)
    if isinstance(weight, Mxfp4Experts):
        return dequantize_mxfp4(weight.codes[expert], weight.scales[expert], dtype)
    if scale is not None:
        return (weight[expert].float() * scale[expert, :, None]).to(dtype)
    return weight[expert]


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
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I] (tensors, or both Int4Experts),
    topk_weights [T, k] (float32) and topk_ids [T, k] -> y [T, H] in x's dtype. scales: fp8
    weights' per-output-channel scales, [E, 2I] and [E, H]; biases: b13 [E, 2I] and b2 [E, H]
    in x's dtype, either None for none; clamped: GPT-OSS's activation instead of SwiGLU."""
    w13_scale, w2_scale = scales if scales is not None else (None, None)
    b13, b2 = biases
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        tokens, slots = torch.nonzero(topk_ids == expert, as_tuple=True)
        gate_up = _expert_weight(w13, w13_scale, expert, x.dtype)
        down = _expert_weight(w2, w2_scale, expert, x.dtype)
        gate_up_bias = None if b13 is None else b13[expert]
        hidden = F.linear(x.index_select(0, tokens), gate_up, gate_up_bias)
        hidden = gated_activation(hidden, clamped)
        contribution = F.linear(hidden, down, None if b2 is None else b2[expert]).float()
        out.index_add_(0, tokens, contribution * topk_weights[tokens, slots, None].float())
    return out.to(x.dtype)
