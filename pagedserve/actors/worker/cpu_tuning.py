"""CPU-side tuning for the worker on a CPU device: glibc malloc thresholds (large per-step
activations reuse warm heap pages), a KV cache in lazily zeroed memory, and transparent huge
pages under it."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import platform

import torch

# glibc malloc serves blocks above its mmap threshold (dynamic, up to 32 MiB) with fresh mmaps
# and unmaps them on free, so every step's large activations (a prefill's [8192, 1536] MLP
# output is 48 MiB) page-fault in anew: ~10x the cost of the kernel writing them. Keeping such
# blocks in the heap and not trimming it lets the next step reuse the same warm pages.
_MALLOC_MMAP_THRESHOLD = 256 << 20
_MALLOC_TRIM_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_malloc_tuned = False


def tune_cpu_malloc() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once; glibc Linux only)."""
    global _malloc_tuned
    if _malloc_tuned:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MALLOC_MMAP_THRESHOLD) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, _MALLOC_TRIM_THRESHOLD) == 1 and ok
    except (OSError, AttributeError):
        return False
    _malloc_tuned = ok
    return ok


_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) over the 2 MiB pages inside a CPU tensor's memory (Linux; a no-op
    elsewhere or under THP=never). Decode reads the paged KV cache block by block from all over
    the cache: with 4 KiB pages nearly every block is a TLB miss."""
    if platform.system() != "Linux" or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // _HUGE_PAGE) * _HUGE_PAGE, end // _HUGE_PAGE * _HUGE_PAGE
    if last <= first:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(first, last - first, _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor in anonymous memory: the kernel's zero pages until first written, so a
    KV cache costs no time at start (zeroing 1 GiB with huge pages took 0.4-2.2 s on the
    2-core development VM) and its pages fault in as blocks are first used. The tensor keeps
    the mapping alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.frombuffer(
        mmap.mmap(-1, max(nbytes, 1)), dtype=dtype, count=math.prod(shape)
    ).view(shape)
