"""Compile Triton kernels in parallel ahead of a run: a compile-only dry run.

Triton compiles a kernel variant the first time a launch needs it, on the launching thread, one
after another; a fresh machine's first engine start spent ~10 s of its ~20 s that way. Inside
`compile_only()` every Triton launch becomes a compile-only `warmup` call, under Triton's
AsyncCompileMode, which hands each new variant's compile to a thread pool; leaving the block
waits for all of them and puts the compiled kernels in the launchers' caches. Compiling releases
the GIL for most of its time (MLIR passes, LLVM, ptxas), so the threads run in parallel
(`scripts/gpu/compile_parallelism.py` measures it).

The caller runs its usual steps inside the block: torch ops and the CUDA C++ kernels still run,
on the uninitialised outputs of the skipped Triton kernels. Such a dry run must not use a Triton
kernel's output as an index (the model runner's dry run samples without logprobs, the only
place where sampled ids index a tensor) and must not read results back.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)


def available() -> bool:
    """Whether this Triton has AsyncCompileMode and compiles (not the CPU interpreter)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    try:
        from triton.runtime import _async_compile  # noqa: F401
    except ImportError:
        return False
    return True


def default_workers() -> int:
    return max(1, min(16, (os.cpu_count() or 1) - 1))


@contextlib.contextmanager
def compile_only(max_workers: int | None = None) -> Iterator[None]:
    """Inside: Triton launches compile (in a thread pool) instead of running. On exit: every
    compile has finished (a failed one raises here)."""
    from triton.runtime._async_compile import AsyncCompileMode
    from triton.runtime.jit import JITFunction

    original = JITFunction.run

    def run_compile_only(self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
        return original(self, *args, grid=grid, warmup=True, **kwargs)

    with ThreadPoolExecutor(max_workers or default_workers()) as pool:
        with AsyncCompileMode(pool):
            JITFunction.run = run_compile_only  # type: ignore[method-assign]
            try:
                yield
            finally:
                JITFunction.run = original  # type: ignore[method-assign]
