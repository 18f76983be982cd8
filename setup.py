"""Install hook: `pip install [-e] .` builds the compiled kernels of csrc/ (as packages with
compiled kernels do) by running `python -m pagedserve.kernels.build` into the package's
kernels/_built (the source tree for an editable install, the wheel otherwise). It never fails
the install: a kernel that cannot be built here is skipped with one line saying why, and the
engine then runs its pure-torch / Triton path. The build needs torch in the build environment:
`pip install --no-build-isolation` after torch (what `make install` does); with pip's default
build isolation it is skipped, and `python -m pagedserve.kernels.build` builds it later.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
BUILD_TIMEOUT_S = 1800  # the CUDA kernel takes ~20 s on 16 cores, minutes on few


def build_kernels(out: Path) -> None:
    """Run the kernel build in its own process group, ended (with every compiler it started)
    if it outlives BUILD_TIMEOUT_S; report, never raise."""
    if importlib.util.find_spec("torch") is None:
        print(
            "pagedserve: torch is not in the build environment, so the compiled kernels were not "
            "built (the pure-torch / Triton paths run); build them with "
            "`python -m pagedserve.kernels.build`, or install with --no-build-isolation"
        )
        return
    command = [sys.executable, "-m", "pagedserve.kernels.build", "--out", str(out)]
    process = subprocess.Popen(command, cwd=ROOT, start_new_session=True)
    try:
        process.wait(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        print(f"pagedserve: the kernel build took over {BUILD_TIMEOUT_S} s and was stopped")
    except BaseException:  # Ctrl-C: no orphaned compilers
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise


class BuildPyAndKernels(build_py):
    def run(self) -> None:
        super().run()
        package = ROOT if self.editable_mode else Path(self.build_lib)
        build_kernels(package / "pagedserve" / "kernels" / "_built")


setup(cmdclass={"build_py": BuildPyAndKernels})
