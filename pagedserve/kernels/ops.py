"""Pure-torch references for the small per-token kernels: RMSNorm (optionally fused with the
residual add), rotary position embedding (neox / rotate-half layout) and SiLU-and-mul.

These are the CPU path and the reference that later Triton/CUDA kernels are checked against.
Numerics follow Hugging Face transformers: the norm is computed in float32 and cast back to the
input dtype before the weight multiply; the residual add happens in the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = weight * (x / sqrt(mean(x^2, -1) + eps)), the mean taken in float32."""
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual; returns (rms_norm(new_residual), new_residual)."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding (the Hugging Face / GPT-NeoX layout).

    x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, head_dim // 2].
    With x = [x1, x2] split in halves: out = [x1*cos - x2*sin, x2*cos + x1*sin].
    """
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate, up] along the last dim; returns silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
