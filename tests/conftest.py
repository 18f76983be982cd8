"""Test-session setup. Triton kernels run on the CPU through Triton's interpreter, which must be
switched on before anything imports triton (torch may import it early).

OpenMP threads (torch's, and the actors' it starts, which inherit the environment) sleep when
they run out of work instead of spinning for it: on a small machine where the test process, an
engine's actor processes and, with `make test`, a second pytest-xdist worker each have a pool
of OpenMP threads, the spinning ones took CPU time from the ones with work (a fifth or more of
the suite's CPU time). Only how idle threads wait changes: the thread count, and so how kernels
split their work, stays the default.

`make test` runs the tests in pytest-xdist workers, a test module to a worker (its module-scoped
engines start once). A test marked `alone` bounds a wall time tightly (a restart within seconds,
a stream not stalled, a round trip within 0.5 s): it waits for the other workers' tests to end
and runs while they wait, as in a run without workers.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "alone: bounds a wall time tightly; under pytest-xdist, runs while no other worker "
        "runs a test",
    )
    workerinput = getattr(config, "workerinput", None)  # set in pytest-xdist workers only
    if workerinput is not None:
        # every worker's basetemp is <the run's basetemp>/popen-gwN: their common directory
        shared = Path(config.option.basetemp).parent
        config.stash[_turns_key] = _Turns(shared)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Each test of a worker (its fixtures' set-up and tear-down included) holds the run's
    lock: shared, or alone (exclusive) for a test marked `alone`."""
    turns = item.config.stash.get(_turns_key, None)
    if turns is None:  # no pytest-xdist workers (or a pytest run started by a test)
        return (yield)
    with turns.held(alone=item.get_closest_marker("alone") is not None):
        return (yield)


class _Turns:
    """A readers-writer lock between the workers of one run, from two flock(2) files: a test
    takes the turnstile, then the lock (shared, or exclusive when alone), and lets the
    turnstile go, so a waiting `alone` test holds the turnstile and no test starts before it.
    The kernel drops a worker's locks if it dies."""

    def __init__(self, directory: Path) -> None:
        # opened once for the session, close-on-exec (no child process shares the locks)
        self._turnstile = os.open(directory / "alone.turnstile", os.O_RDWR | os.O_CREAT, 0o600)
        self._lock = os.open(directory / "alone.lock", os.O_RDWR | os.O_CREAT, 0o600)

    @contextmanager
    def held(self, alone: bool) -> Iterator[None]:
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._lock, fcntl.LOCK_UN)


_turns_key = pytest.StashKey[_Turns]()
