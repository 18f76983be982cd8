"""The `cuda` attention backend: the CUDA C++ decode kernel of csrc/paged_attention_decode.cu
(+ its device code in paged_attention_decode.cuh; built just-in-time with nvcc for the device's
architecture, sm_90 on an H100/H200, on first use), Triton for prefill and the KV write.

Decode math and layout are those of `pagedserve.kernels.attention` (the reference): a
flash-decoding kernel (one CTA per kv head x request x context split, the G query heads of a kv
head together, an online softmax in one pass, a reduce kernel over the splits; see the comment at
the top of the .cuh). Importing this module builds the kernel; on a machine without CUDA or nvcc
the import raises ImportError and the engine falls back (see `attention.resolve_attention_backend`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import torch

from pagedserve.kernels.attention import AttentionMetadata
from pagedserve.kernels.attention import paged_attention as reference_paged_attention

CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc"
CSRC = CSRC_DIR / "paged_attention_decode.cu"
CSRC_HEADER = CSRC_DIR / "paged_attention_decode.cuh"

logger = logging.getLogger(__name__)

__all__ = ["decode", "paged_attention_backend", "write_kv_cache", "reference_paged_attention"]

# What the kernel is instantiated for (csrc/paged_attention_decode.cu).
HEAD_DIMS = (64, 128)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GROUPS = (1, 2, 4, 8)


def _is_built(name: str) -> bool:
    """Whether torch's extension cache already holds this build (then `load` only imports)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists()
    except Exception:  # a private helper of torch's: when it changes, just do not tell
        return True


def _sources_digest() -> str:
    """The build's cache key covers the header too (torch only hashes the listed sources)."""
    digest = hashlib.sha256()
    for path in (CSRC, CSRC_HEADER):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


@functools.cache
def load_extension():
    """Compile (once, cached by torch under ~/.cache/torch_extensions) and import the kernel."""
    if not torch.cuda.is_available():
        raise ImportError("the cuda attention backend needs a CUDA device")
    if not CSRC.exists() or not CSRC_HEADER.exists():
        raise ImportError(f"CUDA sources not found in {CSRC_DIR}")
    from torch.utils.cpp_extension import load

    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    name = f"pagedserve_paged_attention_sm{arch}_{_sources_digest()}"
    if not _is_built(name):
        logger.warning(
            "building the CUDA decode kernel with nvcc: once per machine and source version, "
            "1-2 minutes (`python -c 'import pagedserve.kernels.cuda_attention'` builds it "
            "ahead of time; attention_backend='triton' needs no build)"
        )
    return load(
        name=name,
        sources=[str(CSRC)],
        extra_include_paths=[str(CSRC_DIR)],
        extra_cuda_cflags=[
            "-O3",
            "--use_fast_math",
            f"-gencode=arch=compute_{arch},code=sm_{arch}",
        ],
        verbose=False,
    )


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [batch, num_heads, head_dim] (one query per request); caches
    [num_blocks, block_size, num_kv_heads, head_dim]; block_tables [batch, max_blocks] int32;
    seq_lens [batch] int32 (context incl. this token, already written); returns out like q."""
    if q.dim() != 3 or k_cache.dim() != 4 or q.shape[0] != seq_lens.shape[0]:
        raise ValueError("decode expects q [B, H, D], caches [N, bs, KVH, D], seq_lens [B]")
    if q.shape[-1] != k_cache.shape[-1] or q.dtype != k_cache.dtype:
        raise ValueError("q and the caches must share head_dim and dtype")
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    load_extension().paged_attention_decode(
        out, q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len
    )
    return out


def supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None = None) -> bool:
    """The shapes the kernel is instantiated for (csrc/paged_attention_decode.cu), with cache
    rows it can copy in 16-byte pieces (base pointer and strides 16-byte aligned)."""
    group = q.shape[1] // k_cache.shape[2]
    return (
        q.shape[-1] in HEAD_DIMS
        and q.dtype in DTYPES
        and group in GROUPS
        and q.shape[1] == group * k_cache.shape[2]
        and all(_rows_aligned(c) for c in (k_cache, v_cache) if c is not None)
    )


def _rows_aligned(cache: torch.Tensor) -> bool:
    elt = cache.element_size()
    return (
        cache.data_ptr() % 16 == 0
        and cache.stride(-1) == 1
        and all(stride * elt % 16 == 0 for stride in cache.stride()[:-1])
    )


def paged_attention_backend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Decode-only steps run the CUDA kernel; steps with prefill chunks run Triton's."""
    from pagedserve.kernels import triton_attention

    if metadata.max_query_len != 1 or not supported(q, k_cache, v_cache):
        return triton_attention.paged_attention_backend(q, k_cache, v_cache, metadata, scale)
    return decode(
        q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, scale, metadata.max_seq_len
    )


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    from pagedserve.kernels import triton_attention

    triton_attention.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def _build_on_import() -> None:
    """Importing this module builds the kernel, so a machine that cannot (no CUDA, no nvcc)
    fails the import and the engine falls back to another backend."""
    try:
        load_extension()
    except ImportError:
        raise
    except Exception as exc:  # nvcc or ninja errors
        raise ImportError(f"building the CUDA attention kernel failed: {exc}") from exc


_build_on_import()
