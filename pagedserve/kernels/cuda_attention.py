"""The `cuda` attention backend: the CUDA C++ decode kernel of csrc/ (built just-in-time with nvcc
for the device's architecture, sm_90 on an H100/H200, on first use), Triton for prefill and the
KV write.

Decode math and layout are those of `pagedserve.kernels.attention_ref` (the reference): a
flash-decoding kernel (one CTA per kv head x request x context split, the G query heads of a kv
head together, an online softmax in one pass, a reduce kernel over the splits; see the comment at
the top of csrc/paged_attention_decode.cuh). The build: the binding paged_attention_decode.cpp
(host C++, the only unit reading torch's headers) and one unit per (dtype, head_dim),
paged_attention_decode_<dtype>_hd<head_dim>.cu, instantiating the kernels of the .cuh for every
GQA group; torch's ninja build compiles them in parallel. A build already in torch's extension
cache is imported directly, without torch's `load` (no ninja run, no compiler checks).
Importing this module builds (or loads) the kernel; on a machine without CUDA or nvcc the import
raises ImportError and the engine falls back (see `attention_backends.resolve_attention_backend`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

import torch

from pagedserve.kernels.attention_metadata import AttentionMetadata

CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc"
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
_QUOTED_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)
_BUILD_WARNING = (
    "building the CUDA decode kernel with nvcc: once per machine and source version, "
    "~20 s on 16 cores, longer on fewer "
    "(`python -c 'import pagedserve.kernels.cuda_attention'` builds it ahead of time; "
    "attention_backend='triton' needs no build)"
)


def source_names() -> list[str]:
    """The build's translation units (names in csrc): the binding, then the instantiation
    units, one per (dtype, head_dim)."""
    units = [f"paged_attention_decode_{DTYPE_TAGS[d]}_hd{h}.cu" for d in DTYPES for h in HEAD_DIMS]
    return [BINDING, *units]


def build_inputs() -> list[Path]:
    """Every file of csrc the build reads: the translation units and, transitively, the headers
    they include with quotes (those found next to the includer; csrc is the only user include
    directory), each once."""
    found: list[Path] = []
    pending = [CSRC_DIR / name for name in source_names()]
    while pending:
        path = pending.pop(0).resolve()
        if path in found or not path.is_file():
            continue
        found.append(path)
        pending += [path.parent / name for name in _QUOTED_INCLUDE.findall(path.read_text())]
    return found


def _sources_digest(build_args: Sequence[str] = ()) -> str:
    """12 hex digits of a hash over the names and contents of every build input and over
    `build_args`: the build's cache key (torch's own key covers the listed sources only, and the
    direct import of a cached build skips it)."""
    digest = hashlib.sha256()
    for path in build_inputs():
        data = path.read_bytes()
        digest.update(f"{os.path.relpath(path, CSRC_DIR)}:{len(data)}\n".encode())
        digest.update(data)
    for arg in build_args:
        digest.update(f"{arg}\n".encode())
    return digest.hexdigest()[:12]


def _cuda_flags(arch: str) -> list[str]:
    """nvcc flags of the instantiation units: optimised, for sm_<arch> only."""
    return ["-O3", "--use_fast_math", f"-gencode=arch=compute_{arch},code=sm_{arch}"]


def extension_name(arch: str) -> str:
    """The extension's module name (and torch's cache directory) for sm_<arch>: it changes with
    any build input, compiler flag or the torch version, so a cached build is always current."""
    build_args = [torch.__version__, *CXX_FLAGS, *_cuda_flags(arch)]
    return f"pagedserve_paged_attention_sm{arch}_{_sources_digest(build_args)}"


def _build_directory(name: str) -> Path | None:
    """torch's build (and cache) directory of extension `name`; None when torch's private
    helper is gone (then torch's `load` finds it)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(name, verbose=False))
    except Exception:  # a private helper of torch's: when it changes, do without
        return None


def _cached_library(name: str, build_dir: Path) -> Path | None:
    """The built extension in build_dir if complete: present, and no build holding torch's lock
    file (a build of the same name in another process may be writing it)."""
    library = build_dir / f"{name}.so"
    if library.is_file() and not (build_dir / "lock").exists():
        return library
    return None


def _import_library(name: str, library: Path) -> ModuleType:
    """The extension module `name` imported from its shared library (what torch's `load` does
    after its build step; torch is already imported, as the library needs)."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(library))
    spec = importlib.util.spec_from_file_location(name, library, loader=loader)
    if spec is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _usable_cpus() -> int:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@contextlib.contextmanager
def _default_max_jobs() -> Iterator[None]:
    """A context in which MAX_JOBS (the parallel compiles of torch's ninja build) is the number of
    usable CPUs unless the environment already sets it; unset again on exit."""
    if "MAX_JOBS" in os.environ:
        yield
        return
    os.environ["MAX_JOBS"] = str(_usable_cpus())
    try:
        yield
    finally:
        os.environ.pop("MAX_JOBS", None)


def _build(name: str, arch: str) -> ModuleType:
    """Compile the extension with torch's `load` (ninja, the units in parallel; cached under
    ~/.cache/torch_extensions) and import it."""
    from torch.utils.cpp_extension import load

    with _default_max_jobs():
        return load(
            name=name,
            sources=[str(CSRC_DIR / unit) for unit in source_names()],
            extra_include_paths=[str(CSRC_DIR)],
            extra_cflags=list(CXX_FLAGS),
            extra_cuda_cflags=_cuda_flags(arch),
            verbose=False,
        )


@functools.cache
def load_extension() -> ModuleType:
    """The kernel's extension module: imported directly when torch's cache holds this build,
    else compiled (once per machine and build inputs) and imported by torch's `load`."""
    if not torch.cuda.is_available():
        raise ImportError("the cuda attention backend needs a CUDA device")
    missing = [unit for unit in source_names() if not (CSRC_DIR / unit).is_file()]
    if missing:
        raise ImportError(f"CUDA sources not found in {CSRC_DIR}: {', '.join(missing)}")
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    name = extension_name(arch)
    build_dir = _build_directory(name)
    library = None if build_dir is None else _cached_library(name, build_dir)
    if library is not None:
        try:
            return _import_library(name, library)
        except Exception as exc:  # a broken file: torch's load rebuilds what is out of date
            logger.warning("importing the cached CUDA decode kernel %s failed: %s", library, exc)
    elif build_dir is not None and not (build_dir / f"{name}.so").exists():
        logger.warning(_BUILD_WARNING)
    return _build(name, arch)


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
) -> torch.Tensor:
    """q [batch, num_heads, head_dim] (one query per request); caches
    [num_blocks, block_size, num_kv_heads, head_dim]; block_tables [batch, max_blocks] int32;
    seq_lens [batch] int32 (context incl. this token, already written); returns out like q.
    num_splits (for benchmarks) replaces the planned number of context splits, clamped to
    1..min(key tiles of max_seq_len, 128) and rounded to whole tiles a split as the plan is
    (`planned_num_splits` tells the plan's choice); None keeps the plan."""
    if q.dim() != 3 or k_cache.dim() != 4 or q.shape[0] != seq_lens.shape[0]:
        raise ValueError("decode expects q [B, H, D], caches [N, bs, KVH, D], seq_lens [B]")
    if q.shape[-1] != k_cache.shape[-1] or q.dtype != k_cache.dtype:
        raise ValueError("q and the caches must share head_dim and dtype")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 (None: the planned count), got {num_splits}")
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    splits = 0 if num_splits is None else num_splits  # 0: the planned count
    load_extension().paged_attention_decode(
        out, q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, splits
    )
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
    """The shapes the kernel is instantiated for (see HEAD_DIMS, DTYPES, GROUPS), with cache
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
