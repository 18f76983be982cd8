"""The shape the design keeps: actors import each other only through the wire schema, the
scheduler runs without torch, and modules stay small enough to read."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pagedserve"


def imported_modules(module: str) -> set[str]:
    """The modules a fresh interpreter has loaded after importing `module`."""
    code = f"import sys, {module}; print('\\n'.join(sys.modules))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(run.stdout.split())


def test_the_scheduler_imports_neither_torch_nor_the_worker() -> None:
    loaded = imported_modules("pagedserve.actors.scheduler.actor")
    assert "torch" not in loaded
    assert not any(m.startswith("pagedserve.actors.worker") for m in loaded)


def test_the_worker_imports_nothing_of_the_scheduler() -> None:
    loaded = imported_modules("pagedserve.actors.worker.actor")
    assert not any(m.startswith("pagedserve.actors.scheduler") for m in loaded)


def test_single_machine_use_never_imports_ray() -> None:
    """Ray is an optional extra: only distributed_executor_backend="ray" imports it."""
    loaded = imported_modules("pagedserve.api.llm") | imported_modules("pagedserve.api.cli")
    loaded |= imported_modules("pagedserve.actors.worker.actor")
    assert "ray" not in loaded
    assert "pagedserve.actors.ray_executor" not in loaded


@pytest.mark.parametrize("path", sorted((PACKAGE / "actors").rglob("*.py")), ids=str)
def test_no_actor_module_exceeds_400_lines(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= 400
