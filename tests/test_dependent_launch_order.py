"""The Triton GEMVs keep the programmatic-dependent-launch contract in their compiled code
(csrc/grid_dependency.h): launched as dependents, only weight loads come before the
grid-dependency wait, so a predecessor still running cannot be read too early; without PDL
there is no wait at all. The GPU check (scripts/gpu/check_dependent_launch.py) compares
outputs; this reads the sm_90 SASS, which needs no GPU (scripts/gemv_sass.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from gemv_sass import keeps_the_contract  # noqa: E402


@pytest.mark.parametrize(
    ("order", "dependent_launch", "kept"),
    [
        ("WWWW|^LLS", True, True),
        ("W|^", True, True),
        ("WWLW|^LS", True, False),  # x read before the wait
        ("WWSW|^L", True, False),  # a store before the wait
        ("WWWWLLS", True, False),  # no wait
        ("WW|LL^S", True, False),  # dependents launched late
        ("WW|^L|^L", True, False),  # two waits
        ("WLWWS", False, True),
        ("WW|^LS", False, False),  # a wait in a plain launch
    ],
)
def test_the_contract_as_an_order_of_events(order: str, dependent_launch: bool, kept: bool) -> None:
    assert keeps_the_contract(order, dependent_launch) is kept


def test_the_compiled_gemvs_keep_the_contract() -> None:
    """bf16 single-row, fp8 and int4 Triton GEMVs at Llama-3.1-8B's qkv shape, compiled in a
    process of its own (the suite's Triton is its CPU interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gemv_sass.py"), "--shapes", "6144x4096"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "every kernel keeps the dependent-launch contract" in result.stdout
    assert result.stdout.count("|^") == 3  # the three PDL launches, each with its wait
