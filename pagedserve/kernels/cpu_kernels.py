"""The C++ CPU kernels of csrc/cpu_kernels.cpp (float32, AVX-512 or AVX2 + FMA: the CPU's): built
at install (kernels.build), loaded here as torch ops (`torch.ops.pagedserve_cpu.*`). Off when
EngineConfig.cpu_kernels is off, when the CPU has neither instruction set or when they are not
built for these sources: the pure-torch paths then run, same math.

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

from pagedserve.kernels import extensions
from pagedserve.kernels.extensions import CSRC_DIR, ExtensionSpec, built_library

logger = logging.getLogger(__name__)

# the compiler flags of each instruction set the kernels are built for (csrc/cpu_kernels.cpp's
# V16: one 512-bit register, or two 256-bit ones), by torch's name for the CPU's capability
ISA_FLAGS = {
    "AVX512": ("-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mfma"),
    "AVX2": ("-mavx2", "-mfma"),
}
_loaded: bool | None = None  # this process's load_cpu_kernels() result (torch ops are global)


def cpu_isa() -> str:
    """The CPU's vector instruction set as torch detects it ("AVX512", "AVX2", "DEFAULT", ...)."""
    return torch.backends.cpu.get_cpu_capability()


def cpu_kernels_spec() -> ExtensionSpec:
    """The kernels built for this CPU's instruction set (AVX2's flags where it has neither)."""
    flags = ISA_FLAGS.get(cpu_isa(), ISA_FLAGS["AVX2"])
    return ExtensionSpec(
        base_name="pagedserve_cpu_kernels",
        sources=(CSRC_DIR / "cpu_kernels.cpp",),
        cflags=("-O3", "-ffp-contract=off", *flags, "-fopenmp"),
        ldflags=("-fopenmp",),
    )


def cpu_can_run_kernels() -> bool:
    """Whether this CPU runs the kernels (AVX-512 or AVX2, as torch detects it)."""
    return cpu_isa() in ISA_FLAGS


def find_cpu_kernels(directory: Path | None = None) -> Path | None:
    """The library built for these sources in `directory` (None: extensions.BUILT_DIR), if
    this CPU can run it; None with one log line saying why not (a warning when only the build
    is missing). Never builds, never waits."""
    directory = extensions.BUILT_DIR if directory is None else directory
    if not cpu_can_run_kernels():
        logger.info("the C++ CPU kernels need AVX-512 or AVX2; using the pure-torch paths")
        return None
    library = built_library(cpu_kernels_spec(), directory)
    if library is None:
        logger.warning(
            "the C++ CPU kernels are not built for these sources (in %s); using the pure-torch "
            "paths. `python -m pagedserve.kernels.build` (or `make install`) builds them.",
            directory,
        )
    return library


def load_cpu_kernels() -> bool:
    """Load the built kernels into this process (once); False when they cannot be used here
    (then the torch paths run)."""
    global _loaded
    if _loaded is None:
        library = find_cpu_kernels()
        _loaded = False
        if library is not None:
            try:
                torch.ops.load_library(str(library))
                _loaded = hasattr(torch.ops.pagedserve_cpu, "paged_decode")
            except (OSError, RuntimeError) as exc:  # a broken or foreign library
                logger.warning("loading %s failed (%s); using the pure-torch paths", library, exc)
    return _loaded
