"""The FP8 KV cache (kv_cache_dtype="fp8"): k and v stored as float8_e4m3fn with one scale per
layer for each (per tensor), half the bytes of bf16:

    cache = fp8(clamp(x / scale, +-448))         read back as  x ~ cache * scale

Attention reads the fp8 values directly and folds the scales into its math: scores use
softmax_scale * k_scale, the output is multiplied by v_scale. The scales come from the
checkpoint (k_scale / v_scale tensors) or are 1.0 (vLLM's default). The pure-torch paths index
fp8 tensors through their bytes (torch has no CPU index_copy for fp8).
"""

from __future__ import annotations

import torch

from pagedserve.kernels.quant_ref import FP8_DTYPE, to_fp8


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def to_cache_values(x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    """x as the cache stores it: fp8(x / scale) for an fp8 cache, else x unchanged."""
    return to_fp8(x, scale) if is_fp8(cache) else x


def raw(t: torch.Tensor) -> torch.Tensor:
    """t's bytes (uint8) when it is fp8, for index copies; else t."""
    return t.view(torch.uint8) if is_fp8(t) else t
