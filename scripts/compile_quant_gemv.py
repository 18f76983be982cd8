"""Compile every launch variant of scripts/gpu/sweep_quant_gemv.py for a GPU target on a machine
without one (Triton's compiler and ptxas run on the CPU; nothing is launched): finds variants
that the CPU interpreter runs but the compiler refuses, before a GPU run spends time on them.

    python scripts/compile_quant_gemv.py [--arch 90] [--schemes int4] [--batches 1]
        [--convert half]

Each variant's launch is recorded from the real launcher (triton_quant.int_weight_gemv /
fp8_weight_gemv on small CPU tensors of the sweep's first shape, the H200's 132 SMs assumed)
and compiled with triton.compile; prints one line a failure and the count, exit status 1 on
any failure.
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
sys.path.insert(0, str(ROOT / "scripts/gpu"))
sys.path.insert(0, str(ROOT))

import sweep_quant_gemv as sweep  # noqa: E402

from pagedserve.kernels import triton_quant as tq  # noqa: E402

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.int32: "i32", torch.uint8: "u8"}  # fmt: skip


class _Recorder:
    """Stands in for the kernel: kernel[grid](*args, **kwargs) records the launch."""

    def __init__(self) -> None:
        self.launch: tuple[tuple, dict] | None = None

    def __getitem__(self, grid: tuple) -> object:
        def record(*args: object, **kwargs: object) -> None:
            self.launch = args, kwargs

        return record


def launch_of(scheme: str, m: int, n: int, k: int, config: object) -> tuple[tuple, dict]:
    """The (args, kwargs) the launcher passes to _quant_gemv_kernel for this config."""
    recorder, kernel = _Recorder(), tq._quant_gemv_kernel
    ops = sweep.make_operands(tq, scheme, n, k, "cpu", fill=False)
    tq._quant_gemv_kernel = recorder
    try:
        ops.run(torch.zeros(m, k, dtype=torch.bfloat16), config, False, 0)
    finally:
        tq._quant_gemv_kernel = kernel
    assert recorder.launch is not None
    return recorder.launch


def compile_launch(args: tuple, kwargs: dict, arch: int) -> None:
    fn = tq._quant_gemv_kernel
    names = fn.arg_names
    signature, constexprs = {}, {}
    for i, name in enumerate(names):
        if i < len(args):
            value = args[i]
            signature[name] = f"*{_TYPES[value.dtype]}" if torch.is_tensor(value) else "i32"
        else:
            signature[name] = "constexpr"
            constexprs[(i,)] = kwargs[name]
    options = {"num_warps": kwargs["num_warps"], "num_stages": kwargs["num_stages"]}
    source = ASTSource(fn, signature=signature, constexprs=constexprs)
    triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def root_cause(exc: BaseException) -> str:
    """The innermost cause's type and its last line of text (a CompilationError's own text
    ends in the source excerpt)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [line for line in str(exc).splitlines() if line.strip(" ^")]
    return f"{type(exc).__name__}: {lines[-1].strip()[:200] if lines else ''}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--schemes", nargs="+", default=list(sweep.SCHEMES))
    parser.add_argument("--batches", type=int, nargs="+", default=list(sweep.BATCHES))
    parser.add_argument("--convert", nargs="+", default=None)
    args = parser.parse_args()
    tq._num_sms = lambda _device: 132  # the sweep's GPU: its plans (splits), not the CPU's
    _name, n, k = sweep.SHAPES[0]
    started, done, failed = time.perf_counter(), 0, 0
    for scheme in args.schemes:
        for m in args.batches:
            for config in sweep.variant_configs(tq, scheme, m):
                if args.convert and config.convert not in args.convert:
                    continue
                try:
                    compile_launch(*launch_of(scheme, m, n, k, config), args.arch)
                except Exception as exc:  # reported, the rest go on
                    failed += 1
                    print(f"FAILED {scheme} M={m} {config.describe()}: {root_cause(exc)}",
                          flush=True)  # fmt: skip
                done += 1
    print(f"{done} variants compiled for sm_{args.arch} in {time.perf_counter() - started:.0f} s, "
          f"{failed} failed")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
