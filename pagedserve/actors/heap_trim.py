"""Giving glibc's free heap pages back to the system, now and then.

A process that allocates many short-lived blocks of varying sizes above pymalloc's 512 bytes
(request bodies, JSON, HTTP buffers: the API server) leaves free chunks between live ones in
glibc's main heap. `free` returns memory to the system only from the heap's top, so those
chunks stay resident, and as later requests reuse different parts of them, more of the heap's
pages become resident: RSS creeps up while the memory in use (tracemalloc, pymalloc,
`mallinfo2`) stays flat (in the API server, about half of its ~200 bytes a request;
scripts/results/soak_cpu.md). `malloc_trim(0)` hands back every whole free page inside the
heap (`MADV_DONTNEED`); on a ~120 MiB heap it takes ~0.5 ms. It does not reach pymalloc's
arenas (mmapped, returned only when empty): the rest of the creep.
Elsewhere than glibc there is no `malloc_trim`, and trimming does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

import anyio

logger = logging.getLogger(__name__)


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _malloc_trim()


def can_trim_heap() -> bool:
    return _MALLOC_TRIM is not None


def trim_heap() -> bool:
    """Return glibc's free heap pages to the system; whether any were returned."""
    return _MALLOC_TRIM is not None and _MALLOC_TRIM(0) == 1


async def trim_heap_forever(interval_s: float) -> None:
    """Trim every `interval_s` (a task of the actor's loop: the trim holds malloc's lock, so
    running it in the thread that allocates most means it never waits for it)."""
    if interval_s <= 0 or not can_trim_heap():
        return
    while True:
        await anyio.sleep(interval_s)
        trim_heap()
