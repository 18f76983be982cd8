"""The `cuda` attention backend: the CUDA C++ decode kernel of csrc/ (built at install for the
device's architecture, sm_90 on an H100/H200: kernels.build), Triton for prefill and the KV
write.

Decode math and layout are those of `pagedserve.kernels.attention_ref` (the reference): a
flash-decoding kernel (one CTA per kv head x request x context split, the G query heads of a kv
head together, an online softmax in one pass, a reduce kernel over the splits; see the comment at
the top of csrc/paged_attention_decode.cuh). The build: the binding paged_attention_decode.cpp
(host C++, the only unit reading torch's headers) and one unit per (dtype, head_dim),
paged_attention_decode_<dtype>_hd<head_dim>.cu, instantiating the kernels of the .cuh for every
GQA group; torch's ninja build compiles them in parallel (`cuda_kernel_spec`).
`load_extension` loads the built kernel; on a machine without CUDA, or where it is not built for
these sources, it raises ImportError and the engine falls back to Triton (see
`attention_backends.resolve_attention_backend`). Nothing here compiles.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

import torch

from pagedserve.kernels import extensions
from pagedserve.kernels.attention_metadata import AttentionMetadata
from pagedserve.kernels.extensions import ExtensionSpec, built_library, import_extension

CSRC_DIR = extensions.CSRC_DIR
BINDING = "paged_attention_decode.cpp"  # the unit defining the Python module

logger = logging.getLogger(__name__)

__all__ = [
    "decode",
    "paged_attention_backend",
    "planned_num_splits",
    "write_kv_cache",
]

# What the kernel is instantiated for: a unit per (dtype, head_dim), named by DTYPE_TAGS, each
# for every group of PAGEDSERVE_DECODE_FOR_EACH_GROUP (csrc/paged_attention_decode.h).
HEAD_DIMS = (64, 128)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GROUPS = (1, 2, 4, 8)
DTYPE_TAGS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

CXX_FLAGS = ("-O3",)  # the binding's host compiler flags


def source_names() -> list[str]:
    """The build's translation units (names in csrc): the binding, then the instantiation
    units, one per (dtype, head_dim)."""
    units = [f"paged_attention_decode_{DTYPE_TAGS[d]}_hd{h}.cu" for d in DTYPES for h in HEAD_DIMS]
    return [BINDING, *units]


def build_inputs() -> list[Path]:
    """Every file of csrc the build reads: the translation units and the headers they include
    (extensions.build_inputs)."""
    return extensions.build_inputs(CSRC_DIR, source_names())


def cuda_kernel_spec(arch: str) -> ExtensionSpec:
    """The extension for sm_<arch> (e.g. "90"): its name changes with any build input,
    compiler flag or the torch version, so a built library is always current."""
    return extensions.cuda_module_spec(
        "pagedserve_paged_attention", CSRC_DIR, source_names(), arch, CXX_FLAGS
    )


def device_arch() -> str:
    """The current CUDA device's sm architecture, e.g. "90"."""
    major, minor = torch.cuda.get_device_capability()
    return f"{major}{minor}"


@functools.cache
def load_extension() -> ModuleType:
    """The kernel's extension module for this device, as built at install; ImportError (with
    what to run) when there is none for these sources, or it does not load."""
    if not torch.cuda.is_available():
        raise ImportError("the cuda attention backend needs a CUDA device")
    arch = device_arch()
    library = built_library(cuda_kernel_spec(arch), extensions.BUILT_DIR)
    if library is None:
        raise ImportError(
            f"the CUDA decode kernel is not built for sm_{arch} and these sources: "
            "`python -m pagedserve.kernels.build` (or `make install`) builds it"
        )
    try:
        return import_extension(library)
    except Exception as exc:  # a broken or foreign library
        raise ImportError(f"loading {library} failed: {exc}") from exc


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    dependent_launch: bool = False,
) -> torch.Tensor:
    """q [batch, num_heads, head_dim] (one query per request); caches
    [num_blocks, block_size, num_kv_heads, head_dim]; block_tables [batch, max_blocks] int32;
    seq_lens [batch] int32 (context incl. this token, already written); returns out like q.
    num_splits (for benchmarks) replaces the planned number of context splits, clamped to
    1..min(key tiles of max_seq_len, 128) and rounded to whole tiles a split as the plan is
    (`planned_num_splits` tells the plan's choice); None keeps the plan. dependent_launch: the
    kernels start as programmatic dependents of the kernel before them (PDL, sm_90;
    csrc/grid_dependency.h)."""
    if q.dim() != 3 or k_cache.dim() != 4 or q.shape[0] != seq_lens.shape[0]:
        raise ValueError("decode expects q [B, H, D], caches [N, bs, KVH, D], seq_lens [B]")
    if q.shape[-1] != k_cache.shape[-1] or q.dtype != k_cache.dtype:
        raise ValueError("q and the caches must share head_dim and dtype")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 (None: the planned count), got {num_splits}")
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    splits = 0 if num_splits is None else num_splits  # 0: the planned count
    load_extension().paged_attention_decode(
        out, q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, splits,
        dependent_launch,
    )  # fmt: skip
    return out


def planned_num_splits(
    batch: int, num_kv_heads: int, max_seq_len: int, head_dim: int, group: int, dtype: torch.dtype
) -> int:
    """The number of context splits `decode` plans (num_splits=None) for these shapes on the
    current CUDA device (group: query heads per kv head)."""
    extension = load_extension()
    return int(
        extension.planned_num_splits(batch, num_kv_heads, max_seq_len, head_dim, group, dtype)
    )


def supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None = None) -> bool:
    """The shapes the kernel is instantiated for (see HEAD_DIMS, DTYPES, GROUPS; caches of q's
    dtype: an fp8 cache is Triton's), with cache rows it can copy in 16-byte pieces (base
    pointer and strides 16-byte aligned)."""
    group = q.shape[1] // k_cache.shape[2]
    return (
        q.shape[-1] in HEAD_DIMS
        and q.dtype in DTYPES
        and k_cache.dtype == q.dtype
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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    dependent_launch: bool = False,
) -> torch.Tensor:
    """Decode-only steps run the CUDA kernel (as programmatic dependents with
    dependent_launch); steps with prefill chunks, and fp8 caches, run Triton's."""
    from pagedserve.kernels import triton_attention

    if metadata.max_query_len != 1 or not supported(q, k_cache, v_cache):
        return triton_attention.paged_attention_backend(
            q, k_cache, v_cache, metadata, scale, k_scale, v_scale
        )
    return decode(
        q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, scale, metadata.max_seq_len,
        dependent_launch=dependent_launch,
    )  # fmt: skip


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    from pagedserve.kernels import triton_attention

    triton_attention.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
