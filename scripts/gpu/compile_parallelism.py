"""Does this machine compile Triton kernels in parallel? The same 8 kernel variants compiled one
after another, then from a thread pool, then from a process pool, each time into an empty Triton
cache. If threads are no faster than one after another, compiling holds the GIL.

    python scripts/gpu/compile_parallelism.py [--workers 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _probe_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sa, sb, sc,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """C = softmax-ish(A @ B) rows, a kernel of a typical size to compile."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn, rk = tl.arange(0, BN), tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * sa + (k0 + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        b = tl.load(b_ptr + (k0 + rk)[:, None] * sb + rn[None, :], mask=rn[None, :] < N, other=0.0)
        acc += tl.dot(a, b)
    acc = tl.exp(acc - tl.max(acc, 1)[:, None])
    tl.store(c_ptr + rm[:, None] * sc + rn[None, :], acc.to(tl.bfloat16), mask=rm[:, None] < M)


SIGNATURE = {name: "*bf16" for name in ("a_ptr", "b_ptr", "c_ptr")}
SIGNATURE |= {name: "i32" for name in ("M", "N", "K", "sa", "sb", "sc")}
SIGNATURE |= {name: "constexpr" for name in ("BM", "BN", "BK")}


def compile_variant(index: int) -> float:
    bm, bn, bk = (16, 32, 64, 128)[index % 4], (32, 64)[index // 4 % 2], (32, 64)[index // 8 % 2]
    source = ASTSource(_probe_kernel, SIGNATURE, {"BM": bm, "BN": bn, "BK": bk})
    start = time.perf_counter()
    triton.compile(source, target=GPUTarget("cuda", 90, 32))
    return time.perf_counter() - start


def timed(label: str, run: Callable[[], Iterable[float]]) -> None:
    start = time.perf_counter()
    each = list(run())
    wall = time.perf_counter() - start
    print(f"| {label} | {wall:.2f} | {sum(each):.2f} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--variants", type=int, default=8)
    args = parser.parse_args()
    variants = range(args.variants)
    compile_variant(15)  # import and initialise everything once
    print("| how | wall s | sum of compile s |\n|---|---:|---:|")
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # read at each compile
    timed("one after another", lambda: [compile_variant(i) for i in variants])
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
    with ThreadPoolExecutor(args.workers) as pool:
        timed(f"{args.workers} threads", lambda: pool.map(compile_variant, variants))
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # before the workers start
    with ProcessPoolExecutor(args.workers) as pool:
        list(pool.map(compile_variant, [15] * args.workers))  # start and warm the workers
        timed(f"{args.workers} processes", lambda: pool.map(compile_variant, variants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
