"""Compiled kernels: built when the package is installed, only loaded at run time.

`python -m pagedserve.kernels.build` (which `pip install` and `make install` run) compiles each
extension of csrc/ that this machine can build into BUILT_DIR, one shared library per
extension named after a digest of its sources, flags and torch version (`ExtensionSpec.name`),
so a library is never used with sources it was not built from. At run time the engine looks a
library up by that name and loads it, or falls back to its pure-torch / Triton path with one
warning: starting the engine never compiles, waits on a lock or runs a compiler.

Builds are serialised by a lock file in the output directory holding its owner's pid, host and
start time (`BuildLock`): a lock whose owner is gone (same host, no such process) or which is
older than STALE_LOCK_S is broken; waiting for a live one has a deadline. Inside the lock the
compile goes through torch.utils.cpp_extension.load, in a child process with a deadline (ended
with its compilers when it passes, or on Ctrl-C), in a private build directory whose own lock
file (torch's FileBaton, which records no owner and would make a later build wait forever) can
only be a leftover of an interrupted build, and is removed first.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from pagedserve.cpus import usable_cpus

logger = logging.getLogger(__name__)

BUILT_DIR = Path(__file__).resolve().parent / "_built"
CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc"
STALE_LOCK_S = 30 * 60.0  # a build lock older than this is a leftover, whoever holds it
LOCK_WAIT_S = 15 * 60.0  # the longest a build waits for another process's build
BUILD_TIMEOUT_S = 30 * 60.0  # the longest one compile may take


@dataclass(frozen=True)
class ExtensionSpec:
    """One compiled extension: its sources (paths), their headers (for the digest), flags,
    and whether it is a Python module (pybind) or a library of torch ops (TORCH_LIBRARY)."""

    base_name: str
    sources: tuple[Path, ...]
    headers: tuple[Path, ...] = ()
    cflags: tuple[str, ...] = ()
    cuda_cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    include_dirs: tuple[Path, ...] = ()
    is_python_module: bool = False
    env: tuple[tuple[str, str], ...] = ()  # set while building (TORCH_CUDA_ARCH_LIST)

    @property
    def name(self) -> str:
        """base_name + 12 hex digits of a hash over every source and header (names and
        contents), every flag and the torch version."""
        digest = hashlib.sha256()
        for path in (*self.sources, *self.headers):
            data = path.read_bytes()
            digest.update(f"{path.name}:{len(data)}\n".encode())
            digest.update(data)
        for arg in (torch.__version__, *self.cflags, *self.cuda_cflags, *self.ldflags):
            digest.update(f"{arg}\n".encode())
        return f"{self.base_name}_{digest.hexdigest()[:12]}"


_QUOTED_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def build_inputs(csrc: Path, units: list[str]) -> list[Path]:
    """Every file of `csrc` a build of `units` (names in csrc) reads: the units and,
    transitively, the headers they include with quotes (those found next to the includer; csrc
    is the only user include directory), each once."""
    found: list[Path] = []
    pending = [csrc / name for name in units]
    while pending:
        path = pending.pop(0).resolve()
        if path in found or not path.is_file():
            continue
        found.append(path)
        pending += [path.parent / name for name in _QUOTED_INCLUDE.findall(path.read_text())]
    return found


def nvcc_flags(arch: str) -> list[str]:
    """nvcc flags of a CUDA extension's device units: optimised, for sm_<arch> only."""
    return ["-O3", "--use_fast_math", f"-gencode=arch=compute_{arch},code=sm_{arch}"]


def cuda_module_spec(
    base_name: str, csrc: Path, units: list[str], arch: str, cflags: tuple[str, ...]
) -> ExtensionSpec:
    """A CUDA Python extension of `units` in `csrc` (its binding first) for sm_<arch>: named
    after every build input (the units and the headers they include), flag and the torch
    version."""
    sources = tuple(csrc / name for name in units)
    headers = tuple(path for path in build_inputs(csrc, units) if path not in sources)
    return ExtensionSpec(
        base_name=f"{base_name}_sm{arch}",
        sources=sources,
        headers=headers,
        cflags=cflags,
        cuda_cflags=tuple(nvcc_flags(arch)),
        include_dirs=(csrc,),
        is_python_module=True,
        env=(("TORCH_CUDA_ARCH_LIST", f"{arch[:-1]}.{arch[-1]}"),),
    )


def built_library(spec: ExtensionSpec, directory: Path) -> Path | None:
    """The library built from exactly these sources and flags, if present. Without the
    sources (an installed wheel ships the libraries, not csrc/): the one library of the
    extension there is (a build removes the older ones)."""
    try:
        name = spec.name
    except FileNotFoundError:
        libraries = list(directory.glob(f"{spec.base_name}_*.so"))
        return libraries[0] if len(libraries) == 1 else None
    library = directory / f"{name}.so"
    return library if library.is_file() else None


def import_extension(library: Path) -> ModuleType:
    """A built Python extension module imported from its library (named as its file; torch
    is imported first, as the library needs)."""
    name = library.name.removesuffix(".so")
    loader = importlib.machinery.ExtensionFileLoader(name, str(library))
    spec = importlib.util.spec_from_file_location(name, library, loader=loader)
    if spec is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- the build lock


@dataclass(frozen=True)
class LockOwner:
    pid: int
    host: str
    started: float  # time.time()


def read_lock_owner(path: Path) -> LockOwner | None:
    """The owner written in a lock file; None when it is unreadable (being written, or not a
    file of ours)."""
    try:
        pid, host, started = path.read_text().split()
        return LockOwner(int(pid), host, float(started))
    except (OSError, ValueError):
        return None


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def lock_is_stale(path: Path, now: float | None = None) -> bool:
    """Whether the lock file at `path` is a leftover: its owner process is gone (a lock of this
    host), or it is older than STALE_LOCK_S (by its recorded start or, unreadable, its mtime)."""
    now = time.time() if now is None else now
    owner = read_lock_owner(path)
    try:
        started = owner.started if owner is not None else path.stat().st_mtime
    except FileNotFoundError:
        return False
    if now - started > STALE_LOCK_S:
        return True
    return (
        owner is not None
        and owner.host == socket.gethostname()
        and not (_process_exists(owner.pid))
    )


class BuildLock:
    """An exclusive lock file holding its owner (pid, host, start time)."""

    def __init__(self, path: Path, wait_s: float = LOCK_WAIT_S, poll_s: float = 0.5) -> None:
        self.path, self.wait_s, self.poll_s = path, wait_s, poll_s

    def _try_create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()} {socket.gethostname()} {time.time()}\n")
        return True

    def acquire(self) -> None:
        """Take the lock, breaking a stale one; TimeoutError after wait_s of a live owner."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.wait_s
        while not self._try_create():
            if lock_is_stale(self.path):
                logger.warning("breaking the stale build lock %s", self.path)
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                continue
            if time.monotonic() >= deadline:
                owner = read_lock_owner(self.path)
                raise TimeoutError(f"{self.path} is held by {owner} for over {self.wait_s:.0f} s")
            time.sleep(self.poll_s)

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def __enter__(self) -> BuildLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# --------------------------------------------------------------------------- building

# the compile, in a child process: torch's load also loads what it built (a library of torch
# ops can be registered once per process), and a child can be stopped at a deadline
_COMPILE = (
    "import json, sys\nfrom torch.utils.cpp_extension import load\nload(**json.loads(sys.argv[1]))"
)


def compile_command(spec: ExtensionSpec, work: Path) -> tuple[list[str], dict[str, str]]:
    """The child's command line and environment: torch's load of `spec` into `work`, its
    units compiled in parallel (MAX_JOBS: the usable CPUs unless the environment says), with
    spec.env set over the environment."""
    kwargs = {
        "name": spec.name,
        "sources": [str(path) for path in spec.sources],
        "extra_cflags": list(spec.cflags),
        "extra_cuda_cflags": list(spec.cuda_cflags),
        "extra_ldflags": list(spec.ldflags),
        "extra_include_paths": [str(path) for path in spec.include_dirs],
        "build_directory": str(work),
        "is_python_module": spec.is_python_module,
        "verbose": False,
    }
    env = {"MAX_JOBS": str(usable_cpus()), **os.environ, **dict(spec.env)}
    return [sys.executable, "-c", _COMPILE, json.dumps(kwargs)], env


def run_compile(command: list[str], env: dict[str, str], timeout_s: float) -> None:
    """Run the compile in its own process group, ended with every compiler it started when it
    outlives timeout_s or this process is interrupted; RuntimeError when it fails."""
    process = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        returncode = process.wait(timeout=timeout_s)
    except BaseException as exc:  # the deadline, Ctrl-C: no orphaned ninja or compilers
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise TimeoutError(f"the build took over {timeout_s:.0f} s and was stopped") from exc
        raise
    if returncode != 0:
        raise RuntimeError(f"the compile failed (exit status {returncode}; its output is above)")


def build(spec: ExtensionSpec, directory: Path, timeout_s: float = BUILD_TIMEOUT_S) -> Path:
    """Compile `spec` (unless its library is in `directory` already) and return the library,
    under the directory's build lock; older libraries of the same extension are removed."""
    with BuildLock(directory / ".build.lock"):
        library = built_library(spec, directory)
        if library is not None:
            return library
        work = directory / ".build" / spec.name
        work.mkdir(parents=True, exist_ok=True)
        (work / "lock").unlink(missing_ok=True)  # torch's baton: a leftover under our lock
        run_compile(*compile_command(spec, work), timeout_s)
        library = directory / f"{spec.name}.so"
        partial = directory / f"{spec.name}.so.partial"
        shutil.copy2(work / f"{spec.name}.so", partial)
        partial.replace(library)  # complete, or absent
        shutil.rmtree(work, ignore_errors=True)
        for older in directory.glob(f"{spec.base_name}_*.so"):
            if older != library:
                older.unlink()
        return library
