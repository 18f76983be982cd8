"""Compiled kernels are built at install and only loaded at run time (kernels.extensions):
the build lock's stale-owner detection, a real build of a small torch-op library over an
interrupted earlier build, and an engine start that an interrupted build cannot delay."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.kernels import cpu_kernels, extensions
from pagedserve.kernels.extensions import (
    STALE_LOCK_S,
    BuildLock,
    ExtensionSpec,
    build,
    built_library,
    lock_is_stale,
)
from tests.engine_settings import NO_STANDBY


def dead_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def write_lock(path: Path, pid: int, host: str | None = None, age_s: float = 0.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{pid} {host or socket.gethostname()} {time.time() - age_s}\n")
    return path


# --------------------------------------------------------------------------- the build lock


def test_a_lock_whose_owner_is_gone_is_stale(tmp_path: Path) -> None:
    assert lock_is_stale(write_lock(tmp_path / "dead.lock", dead_pid()))
    assert not lock_is_stale(write_lock(tmp_path / "live.lock", os.getpid()))


def test_a_lock_older_than_the_bound_is_stale_whoever_holds_it(tmp_path: Path) -> None:
    old = STALE_LOCK_S + 60
    assert lock_is_stale(write_lock(tmp_path / "live.lock", os.getpid(), age_s=old))
    other_host = write_lock(tmp_path / "remote.lock", 1, host="another-host")
    assert not lock_is_stale(other_host)  # its pid means nothing here: only its age counts
    assert lock_is_stale(write_lock(tmp_path / "remote.lock", 1, "another-host", age_s=old))
    unreadable = tmp_path / "torch-baton"  # torch's FileBaton: an empty file
    unreadable.write_bytes(b"")
    assert not lock_is_stale(unreadable)
    os.utime(unreadable, (time.time() - old, time.time() - old))
    assert lock_is_stale(unreadable)
    assert not lock_is_stale(tmp_path / "absent.lock")


def test_build_lock_breaks_a_stale_lock_and_waits_for_a_live_one_with_a_deadline(
    tmp_path: Path,
) -> None:
    path = write_lock(tmp_path / ".build.lock", dead_pid())
    start = time.monotonic()
    with BuildLock(path, wait_s=30):
        assert extensions.read_lock_owner(path).pid == os.getpid()
        assert time.monotonic() - start < 5  # broken at once, not waited out
        waiter = BuildLock(path, wait_s=0.5, poll_s=0.05)
        with pytest.raises(TimeoutError, match="held by"):
            waiter.acquire()  # a live owner (this process): waited on, up to the deadline
        assert time.monotonic() - start < 5
    assert not path.exists()


# --------------------------------------------------------------------------- a real build

TOY_SOURCE = r"""
#include <ATen/ATen.h>
#include <torch/library.h>

at::Tensor plus_one(const at::Tensor& x) { return x + 1; }

TORCH_LIBRARY(pagedserve_toy, m) { m.def("plus_one(Tensor x) -> Tensor", &plus_one); }
"""


def test_build_over_an_interrupted_build_and_load(tmp_path: Path) -> None:
    """A build killed earlier left our lock (its owner gone), torch's baton in the build
    directory and no library: the next build breaks both, compiles, and the library loads;
    building again is a no-op; the sources changing changes the name."""
    source = tmp_path / "toy.cpp"
    source.write_text(TOY_SOURCE)
    spec = ExtensionSpec("pagedserve_toy", (source,), cflags=("-O1",))
    out = tmp_path / "built"
    write_lock(out / ".build.lock", dead_pid())
    baton = out / ".build" / spec.name / "lock"
    baton.parent.mkdir(parents=True)
    baton.write_bytes(b"")
    assert built_library(spec, out) is None
    start = time.monotonic()
    library = build(spec, out)
    assert time.monotonic() - start < 240
    assert library == built_library(spec, out) == out / f"{spec.name}.so"
    assert not (out / ".build.lock").exists() and not baton.parent.exists()
    torch.ops.load_library(str(library))
    assert torch.ops.pagedserve_toy.plus_one(torch.zeros(2)).tolist() == [1.0, 1.0]
    assert build(spec, out) == library  # already built: nothing compiled
    source.write_text(TOY_SOURCE + "// edited\n")
    assert built_library(spec, out) is None


def test_without_the_sources_the_one_built_library_is_used(tmp_path: Path) -> None:
    """An installed wheel ships the libraries but not csrc/."""
    spec = ExtensionSpec("pagedserve_toy", (tmp_path / "missing.cpp",))
    (tmp_path / "pagedserve_toy_0123456789ab.so").write_bytes(b"")
    assert built_library(spec, tmp_path) == tmp_path / "pagedserve_toy_0123456789ab.so"
    (tmp_path / "pagedserve_toy_ba9876543210.so").write_bytes(b"")
    assert built_library(spec, tmp_path) is None  # ambiguous: none


# --------------------------------------------------------------------------- run time


def test_cpu_kernels_are_found_or_skipped_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No library for these sources (an interrupted build's lock beside it): None at once,
    with the command that builds it when the CPU could run it."""
    write_lock(tmp_path / ".build.lock", os.getpid())  # a build in progress, say
    start = time.monotonic()
    with caplog.at_level("INFO"):
        assert cpu_kernels.find_cpu_kernels(tmp_path) is None
    assert time.monotonic() - start < 1
    if cpu_kernels.cpu_can_run_kernels():
        assert "python -m pagedserve.kernels.build" in caplog.text
    else:
        assert "need AVX-512" in caplog.text


def test_engine_start_is_not_held_by_an_interrupted_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state an interrupted JIT or install build leaves (locks of processes that no longer
    exist, in torch's extension directory and in ours): a fresh engine reaches ready and
    generates in well under a minute."""
    extensions_dir = tmp_path / "torch_extensions"
    for name in ("pagedserve_cpu_kernels", cpu_kernels.cpu_kernels_spec().name):
        write_lock(extensions_dir / name / "lock", dead_pid())
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions_dir))
    ours = extensions.BUILT_DIR / ".build.lock"
    created = not ours.exists()
    if created:
        write_lock(ours, dead_pid())
    try:
        start = time.monotonic()
        with LLM(num_kv_blocks=64, max_num_seqs=4, supervision=NO_STANDBY) as llm:
            output = llm.generate(["ROMEO:"], SamplingParams(max_tokens=8, temperature=0.0))[0]
        elapsed = time.monotonic() - start
    finally:
        if created:
            ours.unlink(missing_ok=True)
    assert len(output.outputs[0].token_ids) == 8
    assert elapsed < 45, elapsed
