"""The attention backends, chosen once at load by name (`resolve_attention_backend`).

  * "torch_ref": the pure-torch reference (attention_ref), token-major cache; the Triton and
    CUDA kernels are checked against it.
  * "torch": the CPU backend (cpu_attention): a head-major cache, the C++ decode kernel when
    it is loaded and on, else pure torch; per-request SDPA for prefill chunks.
  * "triton", "cuda": token-major, in their own modules. On a GPU the engine's default
    ("auto") is "cuda": the CUDA C++ decode kernel of csrc/ (measured faster than Triton's on
    an H200, scripts/results/kernels_h200.md) with Triton for prefill chunks; "triton" where
    the CUDA kernel cannot be built.

A backend is its two functions (write this step's k/v into a layer's cache, then attend over
it), its cache layout, and what the rest of the engine may do with it: whether the Triton q/k
rotary kernel can write its cache in the same launch, and whether CUDA graphs can capture it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.kernels import attention_ref, cpu_attention
from pagedserve.kernels.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# paged_attention(q, k_cache, v_cache, metadata, scale, k_scale, v_scale) -> out like q; the
# scales are the fp8 cache's (kernels.kv_quant), 1.0 for a cache of the model's dtype; a
# `windowed` backend's also takes the keywords window, softcap and sinks (AttentionBackend)
AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float, float, float],
    torch.Tensor,
]
# write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
KvWriteFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float], None
]


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    attend: AttentionFn
    write_kv_cache: KvWriteFn
    # cache layout: [kv_heads, num_blocks, block_size, head_dim] (head-major) or
    # [num_blocks, block_size, kv_heads, head_dim] (token-major)
    head_major: bool = False
    # its cache write is triton_attention's, which the Triton q/k rotary launch can do itself
    fuses_kv_write: bool = False
    # its steps read no host tensors and sync nothing: CUDA graphs can capture them
    graph_safe: bool = False
    # its attend takes a layer's sliding `window`, logit `softcap` and attention `sinks`
    # (keyword arguments: int, float, float32 [num_heads] tensor or None; attention_ref's doc)
    windowed: bool = True

    def kv_cache_layer_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, int, int, int]:
        """The shape of one layer's k (or v) cache."""
        if self.head_major:
            return (num_kv_heads, num_blocks, block_size, head_dim)
        return (num_blocks, block_size, num_kv_heads, head_dim)


def torch_ref_backend() -> AttentionBackend:
    return AttentionBackend(
        "torch_ref", attention_ref.paged_attention, attention_ref.write_kv_cache
    )


def cpu_backend(use_kernels: bool) -> AttentionBackend:
    """The head-major CPU backend; use_kernels: the C++ kernels (loaded) take what they can."""
    return AttentionBackend(
        "torch",
        functools.partial(cpu_attention.paged_attention_head_major, use_kernel=use_kernels),
        functools.partial(cpu_attention.write_kv_cache_head_major, use_kernel=use_kernels),
        head_major=True,
    )


def triton_backend() -> AttentionBackend:
    from pagedserve.kernels import triton_attention

    return AttentionBackend(
        "triton",
        triton_attention.paged_attention_backend,
        triton_attention.write_kv_cache,
        fuses_kv_write=True,
        graph_safe=True,
    )


def cuda_backend(dependent_launch: bool = False) -> AttentionBackend:
    """The CUDA decode kernel as built at install (ImportError when it cannot load here);
    dependent_launch: its kernels launch as programmatic dependents (PDL, sm_90+)."""
    from pagedserve.kernels import cuda_attention

    cuda_attention.load_extension()
    return AttentionBackend(
        "cuda",
        functools.partial(
            cuda_attention.paged_attention_backend, dependent_launch=dependent_launch
        ),
        cuda_attention.write_kv_cache,
        fuses_kv_write=True,
        graph_safe=True,
        windowed=False,
    )


def resolve_attention_backend(
    name: str,
    use_cpu_kernels: bool = False,
    dependent_launch: bool = False,
    windowed: bool = False,
) -> AttentionBackend:
    """The backend `name` ('auto': 'cuda' on a CUDA machine, else 'torch'); 'cuda' that cannot
    load falls back to 'triton' on a CUDA machine, and any backend that cannot load to 'torch'
    (with a warning). use_cpu_kernels: the 'torch' backend's C++ kernels are loaded and on;
    dependent_launch: the 'cuda' decode kernels launch as programmatic dependents (PDL);
    windowed: the model has layers with a sliding window, a logit softcap or attention sinks,
    which the 'cuda' decode kernel does not take: 'triton' instead."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "torch"
    if name == "cuda" and windowed:
        logger.info(
            "sliding-window / softcap / attention-sink attention: the triton backend instead "
            "of cuda"
        )
        name = "triton"
    if name == "torch_ref":
        return torch_ref_backend()
    if name in ("triton", "cuda"):
        try:
            return cuda_backend(dependent_launch) if name == "cuda" else triton_backend()
        except ImportError as exc:
            reason = str(exc)
        fallback = "triton" if name == "cuda" and torch.cuda.is_available() else "torch"
        logger.warning("attention backend %r unavailable (%s); using %s", name, reason, fallback)
        if fallback == "triton":
            return resolve_attention_backend("triton", use_cpu_kernels)
    elif name != "torch":
        logger.warning("unknown attention backend %r; using torch", name)
    return cpu_backend(use_cpu_kernels)
