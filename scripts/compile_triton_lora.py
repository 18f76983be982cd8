"""Compile the LoRA kernels (pagedserve/kernels/triton_lora.py) for a GPU target on a machine
without one (Triton's compiler and ptxas run on the CPU; nothing is launched): the launches
`add_lora_delta` makes for a small step (K split over programs) and a large one, on Qwen3-0.6B's
projection shapes, bf16 and fp32, are recorded from the real launcher and compiled with
triton.compile. Prints one line a launch and exits 1 on any failure.

    python scripts/compile_triton_lora.py [--arch 90] [--tokens 1 256]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedserve.kernels import triton_lora  # noqa: E402

SHAPES = {
    "qkv": (1024, [2048, 1024, 1024]),
    "gate_up": (1024, [3072, 3072]),
    "down": (3072, [1024]),
}
_TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32"}


class _Recorder:
    """Stands in for a kernel: kernel[grid](*args, **kwargs) records the launch."""

    def __init__(self, fn: triton.runtime.JITFunction) -> None:
        self.fn, self.launches = fn, []

    def __getitem__(self, grid: tuple) -> object:
        def record(*args: object, **kwargs: object) -> None:
            self.launches.append((args, kwargs))

        return record


def launches(tokens: int, dtype: torch.dtype, k: int, sizes: list[int]) -> list[tuple]:
    """(kernel, args, kwargs) of add_lora_delta's two launches for this step."""
    names = ("_shrink_kernel", "_expand_kernel")
    recorders = {name: _Recorder(getattr(triton_lora, name)) for name in names}
    x, y = torch.zeros(tokens, k, dtype=dtype), torch.zeros(tokens, sum(sizes), dtype=dtype)
    a = torch.zeros(4, len(sizes), 16, k, dtype=dtype)
    b = torch.zeros(4, sum(sizes), 16, dtype=dtype)
    order, starts = torch.zeros(tokens, dtype=torch.int32), torch.zeros(5, dtype=torch.int32)
    for name, recorder in recorders.items():
        setattr(triton_lora, name, recorder)
    try:
        triton_lora.add_lora_delta(x, y, a, b, order, starts, sizes)
    finally:
        for name, recorder in recorders.items():
            setattr(triton_lora, name, recorder.fn)
    return [(r.fn, *launch) for r in recorders.values() for launch in r.launches]


def compile_launch(fn: triton.runtime.JITFunction, args: tuple, kwargs: dict, arch: int) -> None:
    signature, constexprs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if i < len(args):
            value = args[i]
            signature[name] = f"*{_TYPES[value.dtype]}" if torch.is_tensor(value) else "i32"
        else:
            signature[name] = "constexpr"
            constexprs[(i,)] = kwargs[name]
    source = ASTSource(fn, signature=signature, constexprs=constexprs)
    triton.compile(source, target=GPUTarget("cuda", arch, 32))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256])
    args = parser.parse_args()
    failed = 0
    for tokens in args.tokens:
        for dtype in (torch.bfloat16, torch.float32):
            for shape, (k, sizes) in SHAPES.items():
                for fn, launch_args, kwargs in launches(tokens, dtype, k, sizes):
                    started = time.perf_counter()
                    label = f"{fn.__name__} {shape} tokens={tokens} {_TYPES[dtype]}"
                    try:
                        compile_launch(fn, launch_args, kwargs, args.arch)
                    except Exception as exc:  # reported, the rest go on
                        failed += 1
                        print(f"FAILED {label}: {type(exc).__name__}: {exc}"[:2000], flush=True)
                        continue
                    print(f"ok {label} ({time.perf_counter() - started:.1f} s)", flush=True)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
