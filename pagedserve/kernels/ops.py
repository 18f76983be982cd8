"""Pure-torch references for the small per-token kernels: RMSNorm (optionally fused with the
residual add), rotary position embedding (neox / rotate-half layout), the attention's q/k step
(per-head RMSNorm then rotary, `qk_norm_rotary`) and SiLU-and-mul.

These are the CPU path and the reference that later Triton/CUDA kernels are checked against.
Numerics follow Hugging Face transformers: the norm is computed in float32 and cast back to the
input dtype before the weight multiply; the residual add happens in the input dtype.

The `*_fast` variants compute the same values with fewer kernel launches (the CPU path is
dominated by per-op overhead at decode batch sizes): `rms_norm_fast` skips the no-op casts of
float32 and adds eps in place, and `apply_rotary_full` takes per-step full-width tables (cos
repeated, sin with the first half negated) shared by every layer and by q and k at once.
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


def qk_norm_rotary(
    qk: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    num_q_heads: int | None = None,
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """The attention's q/k step on qk = [num_tokens, q_heads + kv_heads, head_dim] (q heads
    first): with the weights (Qwen3), rms_norm of each head (q_weight on the first num_q_heads
    heads, k_weight on the others); then apply_rotary with cos_cache[positions],
    sin_cache[positions] on the first rotary_dim dims of each head (None: all; caches
    [max_pos, rotary_dim // 2]), the others kept. Returns a new tensor."""
    if q_weight is not None and k_weight is not None:
        q = rms_norm(qk[:, :num_q_heads], q_weight, eps)
        k = rms_norm(qk[:, num_q_heads:], k_weight, eps)
        qk = torch.cat((q, k), dim=1)
    rotary_dim = qk.shape[-1] if rotary_dim is None else rotary_dim
    rotated = apply_rotary(qk[..., :rotary_dim], cos_cache[positions], sin_cache[positions])
    return torch.cat((rotated, qk[..., rotary_dim:]), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate, up] along the last dim; returns silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_add_rms_norm_fast(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm with the float32 casts skipped when they are no-ops."""
    new_residual = x + residual
    return rms_norm_fast(new_residual, weight, eps), new_residual


def rms_norm_fast(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm without the casts when x is float32 (the same ops otherwise)."""
    if x.dtype != torch.float32:
        return rms_norm(x, weight, eps)
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance.add_(eps)))


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [num_tokens, head_dim // 2] -> [num_tokens, 1, head_dim] tables
    (cat(cos, cos), cat(-sin, sin)) for apply_rotary_full."""
    return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)


def apply_rotary_full(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary with rotary_tables' full-width cos / signed sin: x * cos + swap(x) * sin,
    swap exchanging the halves. The same products and sums as apply_rotary (x2 * -sin is
    -(x2 * sin) exactly), so the same values; x may be any [num_tokens, heads, head_dim] view."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    out = x * cos
    return out.add_(swapped.mul_(sin))
