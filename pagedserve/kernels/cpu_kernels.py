"""The C++ CPU kernels (float32, AVX-512), built with torch.utils.cpp_extension on first use and
cached under TORCH_EXTENSIONS_DIR (~/.cache/torch_extensions): ~25 s the first time on a
machine, ~1 s to load after. Off when EngineConfig.cpu_kernels is off, when the CPU lacks
AVX-512 or when the build fails (no compiler, no ninja): the pure-torch paths then run, same
math.

paged_decode: per (kv head h, request b), its G = num_heads / num_kv_heads query heads at
once, block by block through the block table, reading each K/V row once and in place:
pass 1 s_j = scale * <q_g, K_j> (16 keys at a time, their 16 horizontal sums in one
transpose-and-add tree), pass 2 p_j = exp(s_j - max) (Cephes' exp polynomial, ~1 ulp) and
their sum, pass 3 out_g = sum_j p_j V_j / sum. head_dim 16, 32, 64 or 128; G 1, 2, 4 or 8.
Tasks are split over torch's intra-op threads by kv head, so each thread sees every request
(balanced whatever the context lengths).
The per-token kernels (used by models.layers on the CPU path) fold several ATen ops into one
pass each: rms_norm, fused_add_rms_norm (in place), rotary_inplace (the reference's products
and sums, bit-identical: built with -ffp-contract=off), silu_and_mul, write_kv_head_major.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CPU_KERNELS_CPP = Path(__file__).resolve().parents[2] / "csrc" / "cpu_kernels.cpp"

_cpu_kernel_state: bool | None = None  # None: not tried yet


def load_cpu_kernels() -> bool:
    """Build (first time on a machine) and load the C++ CPU kernels; False when they cannot be
    used here (then the torch paths run). Safe to call repeatedly and from several processes
    (torch's build lock serialises concurrent builds)."""
    global _cpu_kernel_state
    if _cpu_kernel_state is not None:
        return _cpu_kernel_state
    _cpu_kernel_state = False
    try:
        if torch.backends.cpu.get_cpu_capability() != "AVX512":
            return False
        if not hasattr(torch.ops.pagedserve_cpu, "paged_decode"):
            from torch.utils.cpp_extension import load_inline

            logger.info("loading the C++ CPU kernels (built on first use, ~30 s)")
            flags = ["-O3", "-ffp-contract=off", "-mavx512f", "-mavx512dq", "-mavx512bw"]
            flags += ["-mavx512vl", "-mfma"]
            load_inline(
                name="pagedserve_cpu_kernels",
                cpp_sources=[CPU_KERNELS_CPP.read_text()],
                extra_cflags=[*flags, "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
            )
        _cpu_kernel_state = hasattr(torch.ops.pagedserve_cpu, "paged_decode")
    except Exception as exc:  # no compiler, build error, ...: the torch path runs
        logger.warning("C++ CPU kernels unavailable (%s); using the torch paths", exc)
    return _cpu_kernel_state
