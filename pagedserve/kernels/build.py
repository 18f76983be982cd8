"""Build the compiled kernels this machine can build: `python -m pagedserve.kernels.build`.

`pip install` (setup.py) and `make install` run it; run it again after editing csrc/. Each
kernel is built, found already built, or skipped with the reason on one line; a kernel that
is not built leaves the engine on its pure-torch / Triton path (with a warning at start).

  * the C++ CPU kernels (kernels.cpu_kernels), where the CPU has AVX-512 or AVX2;
  * the CUDA decode kernel (kernels.cuda_attention) for each architecture of --cuda-arch, else
    of TORCH_CUDA_ARCH_LIST, else of the visible GPUs; where torch has CUDA and nvcc is found;
  * the CUDA quantized GEMV (kernels.cuda_quant) for those architectures from sm_90 on.

Exit status 1 when a build was tried and failed, else 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagedserve.kernels.cpu_kernels import cpu_can_run_kernels, cpu_kernels_spec
from pagedserve.kernels.cuda_attention import cuda_kernel_spec
from pagedserve.kernels.cuda_quant import MIN_ARCH, cuda_quant_spec
from pagedserve.kernels.extensions import BUILT_DIR, ExtensionSpec, build, built_library


def cuda_archs(requested: list[str]) -> tuple[list[str], str]:
    """The sm architectures to build for ("90", ...) and, when none, why."""
    from torch.utils.cpp_extension import CUDA_HOME

    if torch.version.cuda is None:
        return [], "this torch has no CUDA"
    if CUDA_HOME is None:
        return [], "no CUDA toolkit found (nvcc; set CUDA_HOME)"
    if requested:
        return sorted(set(requested)), ""
    listed = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    # "9.0a" builds as "90": the kernel uses no arch-specific features, and the engine loads
    # the library of the device's plain sm (cuda_attention.device_arch)
    archs = [
        a.split("+")[0].replace(".", "").removesuffix("a") for a in listed.replace(";", " ").split()
    ]
    if not archs and torch.cuda.is_available():
        archs = [
            "{}{}".format(*torch.cuda.get_device_capability(i))
            for i in range(torch.cuda.device_count())
        ]
    if not archs:
        return [], "no GPU visible and no --cuda-arch / TORCH_CUDA_ARCH_LIST"
    return sorted(set(archs)), ""


def _build_one(label: str, spec: ExtensionSpec, out: Path) -> bool:
    """Build spec into out, printing one line; False when the build failed."""
    if built_library(spec, out) is not None:
        print(f"{label}: already built ({out})")
        return True
    start = time.perf_counter()
    print(f"{label}: building...", flush=True)
    try:
        library = build(spec, out)
    except Exception as exc:  # compiler errors, a lock held too long, ...
        print(f"{label}: FAILED ({type(exc).__name__}: {exc}); the engine falls back without it")
        return False
    print(f"{label}: built in {time.perf_counter() - start:.1f} s -> {library}")
    return True


def build_all(out: Path, requested_archs: list[str]) -> bool:
    """Every kernel this machine can build; False when a build failed."""
    jobs: list[tuple[str, Callable[[], ExtensionSpec]]] = []
    if cpu_can_run_kernels():
        jobs.append(("C++ CPU kernels", cpu_kernels_spec))
    else:
        print("C++ CPU kernels: skipped (no AVX-512 or AVX2 on this CPU; the pure-torch paths run)")
    archs, reason = cuda_archs(requested_archs)
    if reason:
        print(f"CUDA decode kernel: skipped ({reason}; the Triton kernels run)")
        print(f"CUDA quantized GEMV: skipped ({reason}; the Triton GEMVs run)")
    for arch in archs:
        jobs.append((f"CUDA decode kernel (sm_{arch})", lambda arch=arch: cuda_kernel_spec(arch)))
        if int(arch) >= MIN_ARCH:
            label = f"CUDA quantized GEMV (sm_{arch})"
            jobs.append((label, lambda arch=arch: cuda_quant_spec(arch)))
        else:
            print(f"CUDA quantized GEMV (sm_{arch}): skipped (needs sm_{MIN_ARCH}+; Triton runs)")
    return all([_build_one(label, spec(), out) for label, spec in jobs])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=BUILT_DIR, help="where the libraries go")
    parser.add_argument(
        "--cuda-arch", action="append", default=[], help='an sm architecture, e.g. "90"'
    )
    args = parser.parse_args(argv)
    return 0 if build_all(args.out, args.cuda_arch) else 1


if __name__ == "__main__":
    sys.exit(main())
