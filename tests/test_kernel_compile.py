"""GPU-only Triton kernels compile for Hopper (sm_90) on this CPU machine: Triton's compiler and
ptxas run without a GPU (scripts/compile_triton_kernels.py records the launchers' real launches and
compiles them), so a kernel that the interpreter runs but the compiler refuses fails here rather
than on the first GPU run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def compiled(kernels: str) -> str:
    """compile_triton_kernels.py's output for one kernel family, for sm_90, 1 and 256 tokens."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "scripts/compile_triton_kernels.py", "--arch", "90", "--tokens",
               "1", "256", "--kernels", kernels]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_the_lora_kernels_compile_for_sm_90() -> None:
    # shrink and expand x three projections x bf16 / fp32 x a small and a large step
    assert compiled("lora").count("\nok ") + 1 == 24


def test_the_moe_kernels_compile_for_sm_90() -> None:
    # (the router, the align and two GEMMs) x bf16 / fp32, and the fp8, the int4 and the MXFP4
    # (GPT-OSS's, with biases and the clamp) experts' align and two GEMMs, each for a small
    # and a large step
    assert compiled("moe").count("\nok ") + 1 == 2 * (4 * 2 + 3 + 3 + 3)


def test_the_rotary_kernel_compiles_for_sm_90() -> None:
    # the q/k norm + rotary + KV write launch: full, partial, and partial with the norms x bf16
    # / fp32 x a small and a large step
    assert compiled("rotary").count("\nok ") + 1 == 3 * 2 * 2


def test_the_attention_kernels_with_a_window_softcap_and_sinks_compile_for_sm_90() -> None:
    # bf16 / fp32 x ((window, softcap, both, window and sinks) x a decode step's decode and
    # reduce kernels, and window and sinks in a step with a prefill chunk: prefill, decode,
    # reduce)
    assert compiled("attention").count("\nok ") + 1 == 2 * (4 * 2 + 3)
