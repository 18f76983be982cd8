"""Running a Triton test file in a fresh process under Triton's CPU interpreter.

TRITON_INTERPRET=1 takes effect only if set before triton is imported; when something in the
test session imported triton first (compiled mode), a kernel test file reruns itself this way.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def assert_passes_in_fresh_interpreter(test_file: str) -> None:
    """Every test of `test_file` passes in a fresh interpreted process, except the one test
    that called this, which skips there."""
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert re.fullmatch(r"\d+ passed, 1 skipped in .*", summary), summary
