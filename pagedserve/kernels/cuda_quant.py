"""The CUDA C++ weight-only GEMV of csrc/quant_gemv* for skinny batches (M <= MAX_ROWS rows:
decode), built at install for sm_90 and later (kernels.build), used by the quantized linear
methods where built (models.quantization: int_weight.py, fp8.py), Triton's GEMV otherwise.

Math and layouts: those of `pagedserve.kernels.quant_ref`, the pure-torch reference (the CPU
path and the oracle of the checks):
    int4 / int8   y = x[..., perm] @ W^T + b,  W[n, k] = (q[n, k] - z[n, g]) s[n, g], g = k // G
    fp8 (E4M3)    y = x @ (Wq s[:, None])^T + b   (W8A16: x stays bf16 / fp16)
computed as sum over steps of 128 columns of s (P - z X) with P = sum x q and X = sum x (int),
s sum x q (fp8): every code exact in x's dtype on the tensor cores (mma.m16n8k16, fp32
accumulation), one rounding to x's dtype. The kernel (csrc/quant_gemv.cuh: the design in its
top comment) streams each weight once as 16-byte vectors, stages x in shared memory, and
splits K over a thread-block cluster whose first CTA sums the partials in a fixed order.

What it takes (`int_weight_problem` / `fp8_weight_problem` name what does not fit): x bf16 or
fp16, 1..MAX_ROWS rows contiguous along K, K a multiple of STEP_K; int codes in the engine's
layout with a group size that is a multiple of STEP_K and scales / zeros of x's dtype; fp8
weights [N, K] with float32 per-channel scales; 16-byte aligned rows.

Launch geometry: kernels.cuda_quant_plan (`plan_gemv`, the measured QUANT_CUDA_TUNED table).
`load_extension` loads the built library; ImportError when there is none for these sources,
for this device, or no CUDA: nothing here compiles.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

import torch

from pagedserve.kernels import extensions
from pagedserve.kernels.cuda_quant_plan import (
    MAX_ROWS,
    STEP_K,
    GemvConfig,
    plan_gemv,
)
from pagedserve.kernels.extensions import ExtensionSpec, built_library, import_extension
from pagedserve.kernels.quant_ref import FP8_DTYPE, IntWeight

logger = logging.getLogger(__name__)

CSRC_DIR = extensions.CSRC_DIR
BINDING = "quant_gemv.cpp"
CXX_FLAGS = ("-O3",)
SCHEMES = ("int4", "int8", "fp8")
DTYPES = (torch.bfloat16, torch.float16)
DTYPE_TAGS = {torch.bfloat16: "bf16", torch.float16: "fp16"}
MIN_ARCH = 90  # thread-block clusters, cvt from e4m3

# the schemes whose decode products take this kernel in the engine (the quantized linear
# methods, where LayerConfig.cuda_quant_gemv): what measured fastest in the whole engine (W3,
# Llama-3.1-8B batch 1, ms/token, session 9 with the tuned table: int4 3.43 vs Triton 4.42, int8
# 4.14 vs 5.63; fp8 3.87 (planner) vs Triton's 2.84, so fp8 stays on Triton's GEMV)
ENGINE_SCHEMES: frozenset[str] = frozenset({"int4", "int8"})


def engine_takes(scheme: str) -> bool:
    """Whether the engine runs `scheme`'s decode products through this kernel (ENGINE_SCHEMES)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}: one of {SCHEMES}")
    return scheme in ENGINE_SCHEMES


# --------------------------------------------------------------------------- operand checks


def _rows_problem(x: torch.Tensor, k: int, aligned: bool) -> str | None:
    if x.dtype not in DTYPES:
        return f"x dtype {x.dtype}: bf16 or fp16"
    if x.dim() < 1 or x.shape[-1] != k:
        return f"x must be [..., {k}]"
    rows = x.numel() // k if k else 0
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows: 1..{MAX_ROWS}"
    if k % STEP_K:
        return f"K = {k}: a multiple of {STEP_K}"
    x2d = x.reshape(-1, k)
    if x2d.stride(-1) != 1:
        return "x must be contiguous along K"
    if aligned and (x2d.data_ptr() % 16 or x2d.stride(0) % 8):
        return "x rows must be 16-byte aligned"
    return None


def _bias_problem(bias: torch.Tensor | None, n: int, dtype: torch.dtype) -> str | None:
    if bias is not None and (bias.shape != (n,) or bias.dtype != dtype or bias.stride(0) != 1):
        return f"bias must be [{n}] of x's dtype, contiguous"
    return None


def _weight_rows_problem(w: torch.Tensor) -> str | None:
    if w.stride(-1) != 1 or w.data_ptr() % 16 or (w.stride(0) * w.element_size()) % 16:
        return "weight rows must be contiguous and 16-byte aligned"
    return None


def _device_problem(*tensors: torch.Tensor | None) -> str | None:
    present = [t for t in tensors if t is not None]
    if any(t.device.type != "cuda" or t.device != present[0].device for t in present):
        return "the operands must be CUDA tensors on one device"
    return None


def int_weight_problem(
    x: torch.Tensor, weight: IntWeight, bias: torch.Tensor | None = None
) -> str | None:
    """Why the kernel does not take these operands (None: it does)."""
    n, k = weight.shape
    perm = weight.perm
    return (
        _rows_problem(x, k, aligned=perm is None)
        or _codes_problem(x, weight)
        or _weight_rows_problem(weight.qweight)
        or _bias_problem(bias, n, x.dtype)
        or _device_problem(x, weight.qweight, weight.scales, weight.zeros, perm, bias)
    )


def _codes_problem(x: torch.Tensor, weight: IntWeight) -> str | None:
    n, k = weight.shape
    expected = {4: ((n, k // 8), torch.int32), 8: ((n, k), torch.uint8)}.get(weight.bits)
    if expected is None:
        return f"{weight.bits}-bit weights: 4 or 8"
    if tuple(weight.qweight.shape) != expected[0] or weight.qweight.dtype != expected[1]:
        return f"qweight must be {expected[1]} {expected[0]}"
    if weight.group_size % STEP_K or k % weight.group_size:
        return f"group size {weight.group_size}: a multiple of {STEP_K} dividing K"
    s, z = weight.scales, weight.zeros
    if s.dtype != x.dtype or z.dtype != x.dtype or z.shape != s.shape or z.stride() != s.stride():
        return "scales and zeros must be x's dtype, [N, K / group], with the same strides"
    perm = weight.perm
    if perm is not None and (
        perm.shape != (k,) or perm.dtype != torch.int64 or perm.stride(0) != 1
    ):
        return f"perm must be int64 [{k}], contiguous"
    return None


def fp8_weight_problem(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> str | None:
    """Why the kernel does not take these operands (None: it does)."""
    if wq.dim() != 2 or wq.dtype != FP8_DTYPE:
        return "wq must be float8_e4m3fn [N, K]"
    n, k = wq.shape
    if w_scale.shape != (n,) or w_scale.dtype != torch.float32 or w_scale.stride(0) != 1:
        return f"w_scale must be float32 [{n}], contiguous"
    return (
        _rows_problem(x, k, aligned=True)
        or _weight_rows_problem(wq)
        or _bias_problem(bias, n, x.dtype)
        or _device_problem(x, wq, w_scale, bias)
    )


# --------------------------------------------------------------------------- launchers


def int_weight_gemv(
    x: torch.Tensor,
    weight: IntWeight,
    bias: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
    dependent_launch: bool = False,
) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows) -> x[..., perm] @ W^T (+ bias), [..., N] of x's
    dtype; ValueError for operands the kernel does not take (int_weight_problem), or a config
    with no launch. config: forced launch parameters (the GPU check's sweep), else planned.
    dependent_launch: launched as a programmatic dependent of the kernel before it (PDL,
    sm_90: its first weights stream while that kernel drains; csrc/grid_dependency.h)."""
    problem = int_weight_problem(x, weight, bias)
    if problem is not None:
        raise ValueError(problem)
    kind = "int4" if weight.bits == 4 else "int8"
    return _launch(x, kind, weight.qweight, weight.scales, weight.zeros, weight.perm, bias,
                   weight.group_size, config, dependent_launch)  # fmt: skip


def fp8_weight_gemv(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
    dependent_launch: bool = False,
) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows) -> x @ (wq * w_scale[:, None])^T (+ bias), the fp8
    weight read once, x not quantized (W8A16); ValueError and dependent_launch as
    int_weight_gemv."""
    problem = fp8_weight_problem(x, wq, w_scale, bias)
    if problem is not None:
        raise ValueError(problem)
    return _launch(x, "fp8", wq, w_scale, None, None, bias, wq.shape[1], config,
                   dependent_launch)  # fmt: skip


def _launch(
    x: torch.Tensor,
    kind: str,
    w: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    perm: torch.Tensor | None,
    bias: torch.Tensor | None,
    group_size: int,
    config: GemvConfig | None,
    dependent_launch: bool,
) -> torch.Tensor:
    n, k = w.shape[0], x.shape[-1]
    x2d = x.reshape(-1, k)
    plan = plan_gemv(kind, x2d.shape[0], n, k, num_sms(x.device), config)
    if plan is None:
        raise ValueError(f"no launch of {kind} {n}x{k} at M = {x2d.shape[0]} fits shared memory")
    out = torch.empty((x2d.shape[0], n), dtype=x.dtype, device=x.device)
    load_extension().quant_gemv(out, x2d, w, scales, zeros, perm, bias, kind, group_size,
                                plan.warps, plan.splits, plan.k_per_split, plan.unroll,
                                dependent_launch)  # fmt: skip
    return out.view(*x.shape[:-1], n)


def int_weight_supported(x: torch.Tensor, weight: IntWeight, bias: torch.Tensor | None) -> bool:
    """Whether int_weight_gemv takes these operands and a launch fits."""
    kind = "int4" if weight.bits == 4 else "int8"
    return int_weight_problem(x, weight, bias) is None and _fits(x, kind, *weight.shape)


def fp8_weight_supported(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> bool:
    """Whether fp8_weight_gemv takes these operands and a launch fits."""
    return fp8_weight_problem(x, wq, w_scale, bias) is None and _fits(x, "fp8", *wq.shape)


def _fits(x: torch.Tensor, kind: str, n: int, k: int) -> bool:
    return plan_gemv(kind, x.numel() // k, n, k, num_sms(x.device)) is not None


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


# --------------------------------------------------------------------------- build and load


def source_names() -> list[str]:
    """The build's translation units (names in csrc): the binding, then one unit per (scheme,
    activation dtype)."""
    units = [f"quant_gemv_{s}_{DTYPE_TAGS[d]}.cu" for s in SCHEMES for d in DTYPES]
    return [BINDING, *units]


def build_inputs() -> list[Path]:
    """Every file of csrc the build reads (extensions.build_inputs)."""
    return extensions.build_inputs(CSRC_DIR, source_names())


def cuda_quant_spec(arch: str) -> ExtensionSpec:
    """The extension for sm_<arch> (>= MIN_ARCH): named after every build input, flag and the
    torch version, so a built library is always current."""
    if int(arch) < MIN_ARCH:
        raise ValueError(f"the quantized GEMV needs sm_{MIN_ARCH} or later, not sm_{arch}")
    return extensions.cuda_module_spec(
        "pagedserve_quant_gemv", CSRC_DIR, source_names(), arch, CXX_FLAGS
    )


@functools.cache
def load_extension() -> ModuleType:
    """The kernel's extension module for this device, as built at install; ImportError (with
    what to run) when there is none for these sources or this device, or it does not load."""
    if not torch.cuda.is_available():
        raise ImportError("the CUDA quantized GEMV needs a CUDA device")
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    if int(arch) < MIN_ARCH:
        raise ImportError(f"the CUDA quantized GEMV needs sm_{MIN_ARCH} or later, not sm_{arch}")
    library = built_library(cuda_quant_spec(arch), extensions.BUILT_DIR)
    if library is None:
        raise ImportError(
            f"the CUDA quantized GEMV is not built for sm_{arch} and these sources: "
            "`python -m pagedserve.kernels.build` (or `make install`) builds it"
        )
    try:
        return import_extension(library)
    except Exception as exc:  # a broken or foreign library
        raise ImportError(f"loading {library} failed: {exc}") from exc


def available() -> bool:
    """Whether the kernel loads here; when not, one warning says why (Triton's GEMV runs)."""
    try:
        load_extension()
    except ImportError as exc:
        logger.warning("CUDA quantized GEMV unavailable (%s); using Triton's", exc)
        return False
    return True
