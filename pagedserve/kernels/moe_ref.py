"""The pure-torch reference of a mixture-of-experts feed-forward (the CPU path's definition;
the Triton kernels of kernels.triton_moe are checked against it).

Math. Token t was routed to experts e_1 .. e_k with weights w_1 .. w_k (the router's top k).
Each expert e is a SwiGLU MLP with w13[e] = [W1; W3] ([2I, H]: gate rows, then up rows) and
w2[e] ([H, I]):

    y[t] = sum_j w_j * W2[e_j] (silu(W1[e_j] x[t]) * W3[e_j] x[t])

Here expert by expert over the tokens routed to it (as transformers computes it), each expert's
contribution weighted in float32 and summed into a float32 output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.ops import silu_and_mul


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] (float32) and topk_ids
    [T, k] -> y [T, H] in x's dtype. scales: fp8 weights' per-output-channel scales, [E, 2I]
    and [E, H] (each expert's weights dequantized into x's dtype where they are used)."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        tokens, slots = torch.nonzero(topk_ids == expert, as_tuple=True)
        gate_up, down = w13[expert], w2[expert]
        if scales is not None:
            gate_up = (gate_up.float() * scales[0][expert, :, None]).to(x.dtype)
            down = (down.float() * scales[1][expert, :, None]).to(x.dtype)
        hidden = silu_and_mul(F.linear(x.index_select(0, tokens), gate_up))
        contribution = F.linear(hidden, down).float()
        out.index_add_(0, tokens, contribution * topk_weights[tokens, slots, None].float())
    return out.to(x.dtype)
