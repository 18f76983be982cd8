"""GPU-only Triton kernels compile for Hopper (sm_90) on this CPU machine: Triton's compiler and
ptxas run without a GPU (scripts/compile_triton_kernels.py records the launchers' real launches and
compiles them), so a kernel that the interpreter runs but the compiler refuses fails here rather
than on the first GPU run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("attention", "lora", "moe", "rotary")
# compile_triton_kernels.py's main() once per family, in one process: its start-up (torch's and
# Triton's imports) is most of a small family's time; a line after each family's output says
# how its main() ended
DRIVER = """
import sys
sys.path.insert(0, "scripts")
import compile_triton_kernels
for family in sys.argv[1:]:
    sys.argv = ["compile_triton_kernels.py", "--arch", "90", "--tokens", "1", "256",
                "--kernels", family]
    print(f"=== {family} exit {compile_triton_kernels.main()}", flush=True)
"""


@pytest.fixture(scope="module")
def compiled_families() -> dict[str, tuple[str, str]]:
    """Per kernel family: compile_triton_kernels.py's output for sm_90, 1 and 256 tokens, and
    how its run ended ("0": every launch compiled)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-c", DRIVER, *FAMILIES]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    outputs, rest = {}, result.stdout
    for family in FAMILIES:
        block, _, rest = rest.partition(f"=== {family} exit ")
        code, _, rest = rest.partition("\n")
        outputs[family] = (block, code)
    return outputs


def compiled(families: dict[str, tuple[str, str]], kernels: str) -> str:
    """One family's output, its run checked to have compiled every launch."""
    output, code = families[kernels]
    assert code == "0", output[-3000:]
    return output


def test_the_lora_kernels_compile_for_sm_90(compiled_families) -> None:
    # shrink and expand x three projections x bf16 / fp32 x a small and a large step
    assert compiled(compiled_families, "lora").count("\nok ") + 1 == 24


def test_the_moe_kernels_compile_for_sm_90(compiled_families) -> None:
    # (the router, the align and two GEMMs) x bf16 / fp32, and the fp8, the int4 and the MXFP4
    # (GPT-OSS's, with biases and the clamp) experts' align and two GEMMs, each for a small
    # and a large step
    assert compiled(compiled_families, "moe").count("\nok ") + 1 == 2 * (4 * 2 + 3 + 3 + 3)


def test_the_rotary_kernel_compiles_for_sm_90(compiled_families) -> None:
    # the q/k norm + rotary + KV write launch: full, partial, and partial with the norms x bf16
    # / fp32 x a small and a large step
    assert compiled(compiled_families, "rotary").count("\nok ") + 1 == 3 * 2 * 2


def test_the_attention_kernels_with_a_window_softcap_and_sinks_compile_for_sm_90(
    compiled_families,
) -> None:
    # bf16 / fp32 x ((window, softcap, both, window and sinks) x a decode step's decode and
    # reduce kernels, and window and sinks in a step with a prefill chunk: prefill, decode,
    # reduce)
    assert compiled(compiled_families, "attention").count("\nok ") + 1 == 2 * (4 * 2 + 3)
