"""One Triton helper the tensor-core kernels share (LoRA's, the experts'): a block product
accumulated in fp32 that the CPU interpreter computes exactly."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def accumulate_dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b in fp32. UPCAST (the CPU interpreter, which multiplies bf16 as raw
    integers): the operands through fp32, exact for bf16 products."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)
