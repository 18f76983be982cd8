"""GPU-only Triton kernels compile for Hopper (sm_90) on this CPU machine: Triton's compiler and
ptxas run without a GPU (scripts/compile_triton_lora.py records the launcher's real launches and
compiles them), so a kernel that the interpreter runs but the compiler refuses fails here rather
than on the first GPU run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_lora_kernels_compile_for_sm_90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "scripts/compile_triton_lora.py", "--arch", "90", "--tokens", "1", "256"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # shrink and expand x three projections x bf16 / fp32 x a small and a large step
    assert result.stdout.count("\nok ") + result.stdout.startswith("ok ") == 24
