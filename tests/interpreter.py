"""Triton kernel tests on the CPU, under Triton's interpreter.

TRITON_INTERPRET=1 takes effect only if set before triton is imported; when something in the
test session imported triton first (compiled mode), a kernel test file reruns itself in a fresh
process. A kernel test module starts with

    IN_PROCESS = interpret_triton()  # before importing torch or the kernels
    ta = interpreted("pagedserve.kernels.triton_attention", "_prefill_kernel", IN_PROCESS)
    _kernels_in_this_process = skip_unless_interpreted(IN_PROCESS)  # an autouse fixture
    test_kernels_in_a_fresh_interpreter_process = fresh_process_test(__file__, IN_PROCESS)
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

FRESH_PROCESS_TEST = "test_kernels_in_a_fresh_interpreter_process"
NOT_IN_PROCESS = "triton was imported in compiled mode: see " + FRESH_PROCESS_TEST


def interpret_triton() -> bool:
    """Import triton with TRITON_INTERPRET=1: whether its kernels run interpreted in this
    process (triton was not imported earlier in compiled mode); when not, TRITON_INTERPRET is
    put back as it was. Skips the calling test module when triton is missing."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language.standard as tl_standard
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError as exc:  # pragma: no cover - depends on the environment
        pytest.skip(f"triton is not importable ({exc}): no kernel tests", allow_module_level=True)
    in_process = isinstance(tl_standard.sum, InterpretedFunction)
    if not in_process:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return in_process


def interpreted(name: str, kernel: str, in_process: bool) -> ModuleType | None:
    """The kernel module `name`, its `kernel` checked to be interpreted (None when not
    in_process)."""
    if not in_process:
        return None
    from triton.runtime.interpreter import InterpretedFunction

    module = importlib.import_module(name)
    assert isinstance(getattr(module, kernel), InterpretedFunction)
    return module


def skip_unless_interpreted(in_process: bool) -> Callable[[pytest.FixtureRequest], None]:
    """An autouse fixture for a kernel test module: its tests skip when its kernels cannot be
    interpreted in this process, all but the fresh-process test."""

    @pytest.fixture(autouse=True)
    def kernels_in_this_process(request: pytest.FixtureRequest) -> None:
        if not in_process and request.node.originalname != FRESH_PROCESS_TEST:
            pytest.skip(NOT_IN_PROCESS)

    return kernels_in_this_process


def fresh_process_test(test_file: str, in_process: bool) -> Callable[[], None]:
    """The module's FRESH_PROCESS_TEST: the file in a fresh process, when triton was imported
    too early to interpret here."""

    def test_kernels_in_a_fresh_interpreter_process() -> None:
        if in_process:
            pytest.skip("the kernels run in this process")
        assert_passes_in_fresh_interpreter(test_file)

    return test_kernels_in_a_fresh_interpreter_process


def assert_passes_in_fresh_interpreter(test_file: str) -> None:
    """Every test of `test_file` passes in a fresh interpreted process, except the one test
    that called this, which skips there."""
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert re.fullmatch(r"\d+ passed, 1 skipped(, \d+ warnings?)? in .*", summary), summary
