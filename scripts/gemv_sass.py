#!/usr/bin/env python3
"""The engine's single-row GEMVs compiled for sm_90 on a machine without a GPU: registers,
stack, SASS instructions and global loads per kernel, with programmatic dependent launch off
and on, and where the grid-dependency wait (ACQBULK) and the dependents' launch (PREEXIT) sit
among the loads. Triton's wheel carries ptxas, nvdisasm and cuobjdump, so no CUDA toolkit is
needed; a GPU machine's Triton can be used here too by putting its wheel first on PYTHONPATH
(the H200 image has triton 3.6: `pip download --no-deps triton==3.6.0`, unzip it).

Each launch is the engine's own: the launcher (triton_gemv.skinny_linear,
triton_quant.fp8_weight_gemv / int_weight_gemv) runs on CPU tensors with its kernel replaced by
a recorder, planned for an H200 (132 SMs), and the recorded call is compiled ahead of time with
16-byte divisibility on pointers and on the multiples of 16, as the launcher would specialise
it. It exits with an error when a kernel breaks the contract of csrc/grid_dependency.h: with
PDL, only weight loads may come before the wait, and the dependents' launch right after it
(tests/test_dependent_launch_order.py runs it). --sass DIR writes each disassembly there.

    python scripts/gemv_sass.py [--shapes 6144x4096 4096x14336] [--sass DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve.kernels import quant_ref  # noqa: E402
from pagedserve.kernels import triton_gemv as tg  # noqa: E402
from pagedserve.kernels import triton_quant as tq  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
H200_SMS = 132
POINTER_TYPES = {torch.bfloat16: "*bf16", torch.uint8: "*u8", torch.float32: "*fp32",
                 torch.int32: "*i32", torch.int64: "*i64"}  # fmt: skip
LAUNCH_OPTIONS = ("num_warps", "num_stages")
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


class Recorder:
    """Stands in for a JIT kernel: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self, fn: triton.JITFunction) -> None:
        self.fn = fn
        self.call: tuple[tuple, dict] | None = None

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        def record(*args: object, **kwargs: object) -> None:
            self.call = (args, kwargs)

        return record


def compile_call(
    fn: triton.JITFunction, args: tuple, kwargs: dict
) -> triton.compiler.CompiledKernel:
    names = fn.arg_names
    signature, attrs, constexprs, options = {}, {}, {}, {}
    for index, (name, value) in enumerate(zip(names, args)):
        if isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if isinstance(value, int) and value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    for name, value in kwargs.items():
        if name in LAUNCH_OPTIONS:
            options[name] = value
        elif name != "launch_pdl":  # a launch attribute: the same binary
            signature[name] = "constexpr"
            constexprs[(names.index(name),)] = value
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=TARGET, options=options)


def describe(kernel: triton.compiler.CompiledKernel) -> tuple[str, str, str]:
    """(the summary line, the order of its loads, stores and grid-dependency instructions, the
    disassembly)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as file:
        file.write(kernel.asm["cubin"])
    try:
        sass = subprocess.run([BIN / "nvdisasm", "-c", file.name], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
        usage = subprocess.run([BIN / "cuobjdump", "--dump-resource-usage", file.name],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
    finally:
        os.unlink(file.name)
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", usage)
    regs, stack = found.groups() if found else ("?", "?")
    instructions = [line for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]
    order = "".join(_event(line) for line in instructions)
    line = (f"regs {regs}, stack {stack}, {len(instructions)} instructions, "
            f"{order.count('W') + order.count('L')} loads; order {order[:24]}")  # fmt: skip
    return line, order, sass


def _event(instruction: str) -> str:
    """W: a weight load (the GEMVs' evict-first LDG), L: another global load, S: a global store
    or atomic, |: griddepcontrol.wait, ^: griddepcontrol.launch_dependents, else nothing."""
    for mark, pattern in (("W", "LDG.E.EF"), ("L", "LDG"), ("S", r"\b(STG|ATOMG|REDG|RED)\b"),
                          ("|", "ACQBULK"), ("^", "PREEXIT")):  # fmt: skip
        if re.search(pattern, instruction):
            return mark
    return ""


def keeps_the_contract(order: str, dependent_launch: bool) -> bool:
    """csrc/grid_dependency.h's contract in a kernel's event order: launched as a dependent,
    only weight loads before the one wait, the dependents' launch right after it; else
    neither instruction."""
    if not dependent_launch:
        return "|" not in order and "^" not in order
    before, wait, after = order.partition("|")
    return (
        bool(wait)
        and set(before) <= {"W"}
        and after.startswith("^")
        and "|" not in after
        and "^" not in after[1:]
    )


def launches(n: int, k: int) -> dict[str, Callable[[bool], None]]:
    """Per GEMV: a call of its launcher for an [n, k] weight, x of one row."""
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    wq, w_scale = torch.zeros(n, k, dtype=torch.float8_e4m3fn), torch.ones(n)
    int4 = quant_ref.quantize_int_weight(torch.randn(n, k), 4, 128, symmetric=False)
    int4 = quant_ref.IntWeight(int4.qweight, int4.scales.bfloat16(), int4.zeros.bfloat16(), 4,
                               128, None)  # fmt: skip
    weight = torch.zeros(n, k, dtype=torch.bfloat16)
    return {
        "bf16 skinny": lambda pdl: tg.skinny_linear(x, weight, dependent_launch=pdl),
        "fp8 (Triton)": lambda pdl: tq.fp8_weight_gemv(x, wq, w_scale, dependent_launch=pdl),
        "int4 (Triton)": lambda pdl: tq.int_weight_gemv(x, int4, dependent_launch=pdl),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["6144x4096", "28672x4096", "4096x14336"])
    parser.add_argument("--sass", type=Path, help="write each disassembly into this folder")
    args = parser.parse_args()
    broken = []
    tg._num_sms = tq._num_sms = lambda device: H200_SMS  # plan for an H200
    skinny, quant = Recorder(tg._skinny_linear_kernel), Recorder(tq._quant_gemv_kernel)
    tg._skinny_linear_kernel, tq._quant_gemv_kernel = skinny, quant  # type: ignore[assignment]
    print(
        f"triton {triton.__version__}, sm_90; order: W weight load, L other load, "
        "| griddepcontrol.wait, ^ launch_dependents"
    )
    print("| GEMV | N x K | PDL | kernel |\n|---|---|---|---|")
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        for name, launch in launches(n, k).items():
            recorder = skinny if name == "bf16 skinny" else quant
            for pdl in (False, True):
                launch(pdl)
                assert recorder.call is not None
                line, order, sass = describe(compile_call(recorder.fn, *recorder.call))
                print(f"| {name} | {shape} | {pdl} | {line} |", flush=True)
                if not keeps_the_contract(order, pdl):
                    broken.append(f"{name} {shape} dependent_launch={pdl}: {order}")
                if args.sass:
                    args.sass.mkdir(parents=True, exist_ok=True)
                    tag = re.sub(r"\W+", "_", f"{name}_{shape}_{pdl}")
                    (args.sass / f"{tag}.sass").write_text(sass)
    if broken:
        sys.exit("the dependent-launch contract is broken:\n" + "\n".join(broken))
    print("every kernel keeps the dependent-launch contract (csrc/grid_dependency.h)")


if __name__ == "__main__":
    main()
