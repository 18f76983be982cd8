"""The per-actor profiling scripts (scripts/profile, issue 11) still run against the engine.

Each runs with its smallest sizes in a subprocess of its own, all started at once: their
actors' start-ups (mostly imports) are most of the time, ~14 s for the file on the idle 2-core
VM. A script passes when it prints its table: one row per size asked, a positive figure in
each. (api_server.py's `--streams` mode is left out: one more API server start, ~5 s of CPU.)
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Case:
    script: str  # in scripts/profile
    args: tuple[str, ...]
    column: str  # the column that names each row
    rows: tuple[str, ...]  # its value in each row, in order: one row per size asked
    figure: str  # a column that must be positive in every row


BUS_PATHS = ("bus", "floor", "floor-paced")
CASES = {
    "scheduler": Case(
        "scheduler", ("--running", "4", "16", "--steps", "20"), "running", ("4", "16"), "steps/s"
    ),
    "bus": Case(
        "bus",
        ("--decodes", "4", "--iterations", "20", "--rounds", "1", "--variants", *BUS_PATHS),
        "path",
        BUS_PATHS,
        "round trip µs p50",
    ),
    "detokenizer": Case(
        "detokenizer",
        ("--streams", "1", "4", "--steps", "20", "--stop", "zz", "--text"),
        "streams",
        ("1", "4"),
        "tokens/s",
    ),
    "tokenizer": Case(
        "tokenizer",
        ("--requests", "20", "--prompt-chars", "50"),
        "prompt chars",
        ("50",),
        "requests/s",
    ),
    "worker": Case(  # two batch sizes: the second runs as a new scheduler epoch
        "worker", ("--batch", "1", "2", "--steps", "4"), "batch", ("1", "2"), "tokens/s"
    ),
    "api_server": Case(
        "api_server",
        ("--requests", "4", "--concurrency", "2"),
        "stream",
        ("False", "True"),
        "requests/s",
    ),
}


def table(stdout: str) -> list[dict[str, str]]:
    """The rows of the markdown table a script printed, as {column: cell}."""
    lines = [line for line in stdout.splitlines() if line.startswith("|")]
    header, *rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return [dict(zip(header, row, strict=True)) for row in rows if not row[0].startswith("-")]


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, subprocess.Popen[str]]]:
    """Every case's script, started at once."""
    processes = {
        name: subprocess.Popen(
            [sys.executable, str(ROOT / "scripts" / "profile" / f"{case.script}.py"), *case.args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, case in CASES.items()
    }
    yield processes
    for process in processes.values():
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("name", list(CASES))
def test_profile_script_prints_its_table(runs: dict[str, subprocess.Popen[str]], name: str) -> None:
    case, process = CASES[name], runs[name]
    stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    assert process.returncode == 0, stderr[-4000:]
    rows = table(stdout)
    assert tuple(row[case.column] for row in rows) == case.rows, stdout
    assert all(float(row[case.figure]) > 0 for row in rows), stdout
