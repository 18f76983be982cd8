"""The `cuda` attention backend (csrc/paged_attention_decode*) on a machine without a GPU.

Without CUDA, or without a library built for these sources, `load_extension` raises ImportError
(it never compiles), so that the engine falls back to another backend. With torch's CUDA
queries, `load` and the extension loader replaced by fakes, the build and load logic is checked
here too: the import of a built library, the build (kernels.extensions.build) of the kernel's
spec, its cache key and its sources. The kernel itself is checked on a GPU by
scripts/gpu/bench_kernels.py (rows impl=cuda, against the torch reference).
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import inspect
import json
import logging
import os
import re
import shutil
import subprocess
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedserve.kernels import cuda_attention, extensions
from pagedserve.kernels.attention_backends import resolve_attention_backend
from pagedserve.kernels.attention_metadata import build_attention_metadata

CSRC = Path(__file__).resolve().parents[1] / "csrc"
C_TYPES = {"bf16": "__nv_bfloat16", "fp16": "__half", "fp32": "float"}

needs_no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a CUDA machine may have the kernel built"
)


@needs_no_cuda
def test_load_fails_cleanly_without_cuda(caplog: pytest.LogCaptureFixture) -> None:
    cuda_attention.load_extension.cache_clear()
    with pytest.raises(ImportError, match="CUDA device"):
        cuda_attention.load_extension()
    with caplog.at_level(logging.WARNING):
        backend = resolve_attention_backend("cuda")
    assert backend.name == "torch" and backend.head_major
    [record] = caplog.records  # one warning, saying why
    assert "attention backend 'cuda' unavailable" in record.getMessage()
    assert "CUDA device" in record.getMessage()


# ------------------------------------------------------------------ fakes of torch's build side


@dataclasses.dataclass
class FakeCuda:
    """An sm_90 machine as far as the code can tell: the compile (torch's `load` in a child
    process, which writes the library into its build directory) and the extension loader
    replaced, recording what they are asked."""

    built_dir: Path
    loader_fails: bool = False  # importing the built library fails (a broken file, say)
    loads: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    env_in_load: list[dict[str, str | None]] = dataclasses.field(default_factory=list)
    imported: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    decode_calls: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)
    plan_calls: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)

    def extension(self, name: str) -> types.ModuleType:
        """A stand-in for the built extension module, recording its calls."""
        module = types.ModuleType(name)
        module.paged_attention_decode = lambda *args: self.decode_calls.append(args)
        module.planned_num_splits = lambda *args: self.plan_calls.append(args) or 7
        return module

    def run_compile(self, command: list[str], env: dict[str, str], timeout_s: float) -> None:
        """extensions.run_compile: 'compiles' what the child's torch load is asked for."""
        kwargs = json.loads(command[-1])
        self.loads.append(kwargs)
        self.env_in_load.append({n: env.get(n) for n in ("MAX_JOBS", "TORCH_CUDA_ARCH_LIST")})
        assert not (Path(kwargs["build_directory"]) / "lock").exists()  # no stale baton
        (Path(kwargs["build_directory"]) / f"{kwargs['name']}.so").write_bytes(b"\x7fELF")

    def loader_class(self) -> type:
        """A replacement for importlib.machinery.ExtensionFileLoader."""
        fake = self

        class Loader(importlib.abc.Loader):
            def __init__(self, name: str, path: str) -> None:
                self.name, self.path = name, path

            def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
                if fake.loader_fails:
                    raise ImportError(f"{self.path}: undefined symbol: _ZN3c104cuda6broken")
                fake.imported.append((self.name, self.path))
                return fake.extension(self.name)

            def exec_module(self, module: types.ModuleType) -> None:
                pass

        return Loader

    def build(self) -> Path:
        return extensions.build(cuda_attention.cuda_kernel_spec("90"), self.built_dir)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeCuda]:
    fake = FakeCuda(tmp_path / "built")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(extensions, "BUILT_DIR", fake.built_dir)
    monkeypatch.setattr(extensions, "run_compile", fake.run_compile)
    monkeypatch.setattr(importlib.machinery, "ExtensionFileLoader", fake.loader_class())
    monkeypatch.delenv("MAX_JOBS", raising=False)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    cuda_attention.load_extension.cache_clear()
    yield fake
    cuda_attention.load_extension.cache_clear()


@pytest.fixture
def loaded(fake_cuda: FakeCuda) -> types.ModuleType:
    """The backend's module with its (fake) kernel built and loaded."""
    fake_cuda.build()
    cuda_attention.load_extension()
    return cuda_attention


# ------------------------------------------------------------------ building and loading


def test_a_built_kernel_is_imported_and_nothing_compiles_at_run_time(fake_cuda: FakeCuda) -> None:
    library = fake_cuda.build()
    assert len(fake_cuda.loads) == 1
    name = cuda_attention.cuda_kernel_spec("90").name
    assert library == fake_cuda.built_dir / f"{name}.so"
    cuda_attention.load_extension()
    assert fake_cuda.imported == [(name, str(library))]
    assert len(fake_cuda.loads) == 1  # loading never builds
    backend = resolve_attention_backend("cuda")
    assert backend.name == "cuda" and backend.graph_safe and backend.fuses_kv_write


def test_no_built_kernel_falls_back_to_triton_with_one_warning(
    fake_cuda: FakeCuda, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ImportError, match="python -m pagedserve.kernels.build"):
        cuda_attention.load_extension()
    with caplog.at_level(logging.WARNING):
        backend = resolve_attention_backend("cuda")
    assert backend.name == "triton"
    [record] = caplog.records
    assert "not built for sm_90" in record.getMessage() and "using triton" in record.getMessage()
    assert fake_cuda.loads == []  # nothing compiled


def test_a_broken_library_falls_back(fake_cuda: FakeCuda) -> None:
    fake_cuda.build()
    fake_cuda.loader_fails = True
    with pytest.raises(ImportError, match="undefined symbol"):
        cuda_attention.load_extension()
    assert resolve_attention_backend("cuda").name == "triton"


def test_build_compiles_every_unit_for_the_arch(fake_cuda: FakeCuda) -> None:
    """All units in one torch build, nvcc flags for sm_90, MAX_JOBS (the usable CPUs) and
    TORCH_CUDA_ARCH_LIST set only while building, in a private build directory whose leftover
    lock (torch's baton from an interrupted build) is removed; a second build is a no-op."""
    spec = cuda_attention.cuda_kernel_spec("90")
    work = fake_cuda.built_dir / ".build" / spec.name
    work.mkdir(parents=True)
    (work / "lock").write_bytes(b"")
    fake_cuda.build()
    [kwargs] = fake_cuda.loads
    assert kwargs["name"] == spec.name and kwargs["is_python_module"]
    units = sorted(p.name for p in CSRC.glob("paged_attention_decode*.c*") if p.suffix != ".cuh")
    assert sorted(Path(s).name for s in kwargs["sources"]) == units
    assert len(units) == 1 + len(cuda_attention.DTYPES) * len(cuda_attention.HEAD_DIMS)
    assert "-gencode=arch=compute_90,code=sm_90" in kwargs["extra_cuda_cflags"]
    jobs = str(extensions.usable_cpus())
    assert fake_cuda.env_in_load == [{"MAX_JOBS": jobs, "TORCH_CUDA_ARCH_LIST": "9.0"}]
    assert "MAX_JOBS" not in os.environ and "TORCH_CUDA_ARCH_LIST" not in os.environ
    assert not work.exists() and not (fake_cuda.built_dir / ".build.lock").exists()
    fake_cuda.build()
    assert len(fake_cuda.loads) == 1


def test_build_keeps_a_max_jobs_the_environment_sets(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MAX_JOBS", "3")
    fake_cuda.build()
    assert fake_cuda.env_in_load[0]["MAX_JOBS"] == "3"
    assert os.environ["MAX_JOBS"] == "3"


def test_a_new_build_replaces_the_older_library(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = fake_cuda.build()
    monkeypatch.setattr(cuda_attention, "CXX_FLAGS", ("-O2",))
    new = fake_cuda.build()
    assert new != old and new.is_file() and not old.exists()


# ------------------------------------------------------------------ the cache key and the sources


def test_build_inputs_are_all_the_kernel_files_of_csrc() -> None:
    inputs = {path.name for path in cuda_attention.build_inputs()}
    # its own files and the header of programmatic dependent launches it shares
    own = {path.name for path in CSRC.glob("paged_attention_decode*")}
    assert inputs == own | {"grid_dependency.h"}
    assert {"paged_attention_decode.h", "paged_attention_decode.cuh"} <= inputs


def _name() -> str:
    return cuda_attention.cuda_kernel_spec("90").name


def test_name_changes_with_every_build_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    monkeypatch.setattr(cuda_attention, "CSRC_DIR", csrc)
    base = _name()
    for path in cuda_attention.build_inputs():
        text = path.read_text()
        path.write_text(text + "\n// edited\n")
        assert _name() != base, path.name
        path.write_text(text)
    assert _name() == base


def test_name_follows_new_includes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    monkeypatch.setattr(cuda_attention, "CSRC_DIR", csrc)
    header = csrc / "paged_attention_decode.cuh"
    header.write_text(header.read_text().replace("#pragma once", '#pragma once\n#include "x.h"'))
    (csrc / "x.h").write_text("#pragma once\n")
    assert csrc / "x.h" in cuda_attention.build_inputs()
    before = _name()
    (csrc / "x.h").write_text("#pragma once\nconstexpr int X = 1;\n")
    assert _name() != before


def test_name_changes_with_flags_arch_and_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    name = _name()
    assert name.startswith("pagedserve_paged_attention_sm90_")
    other_arch = cuda_attention.cuda_kernel_spec("100").name
    assert other_arch != name.replace("sm90", "sm100")
    with monkeypatch.context() as patch:
        patch.setattr(cuda_attention, "CXX_FLAGS", ("-O2",))
        assert _name() != name
    with monkeypatch.context() as patch:
        patch.setattr(torch, "__version__", "0.0.0")
        assert _name() != name
    assert _name() == name


def test_units_instantiate_what_python_dispatches_to() -> None:
    """One unit per (dtype, head_dim); the groups, head dims and dtypes of the C++ side are those
    `supported` accepts."""
    for dtype in cuda_attention.DTYPES:
        tag = cuda_attention.DTYPE_TAGS[dtype]
        for head_dim in cuda_attention.HEAD_DIMS:
            unit = (CSRC / f"paged_attention_decode_{tag}_hd{head_dim}.cu").read_text()
            assert '#include "paged_attention_decode.cuh"' in unit
            assert f"PAGEDSERVE_DECODE_INSTANTIATE({C_TYPES[tag]}, {head_dim})" in unit
    header = (CSRC / "paged_attention_decode.h").read_text()
    groups = header.split("#define PAGEDSERVE_DECODE_FOR_EACH_GROUP", 1)[1].split("\n\n")[0]
    assert tuple(int(g) for g in re.findall(r"X\(T, HEAD_DIM, (\d+)\)", groups)) == (
        cuda_attention.GROUPS
    )
    binding = (CSRC / cuda_attention.BINDING).read_text()
    head_dims = re.findall(r"case (\d+): return dispatch_group<T, \1>", binding)
    assert tuple(int(h) for h in head_dims) == cuda_attention.HEAD_DIMS
    assert set(re.findall(r"dispatch_head_dim<(\w+)>\(head_dim", binding)) == set(C_TYPES.values())


def test_only_the_binding_reads_torch_and_defines_the_module() -> None:
    """The instantiation units stay free of torch's headers (they compile in seconds) and the
    binding of device code (a host C++ unit)."""
    binding = CSRC / cuda_attention.BINDING
    torch_include = re.compile(r"#include <(torch|ATen|c10)/")
    for path in cuda_attention.build_inputs():
        text = path.read_text()
        assert ("PYBIND11_MODULE(" in text) == (path == binding), path.name
        assert bool(torch_include.search(text)) == (path == binding), path.name
    assert binding.suffix == ".cpp"
    assert '#include "paged_attention_decode.cuh"' not in binding.read_text()


# ------------------------------------------------------------------ decode's split override


def _decode_inputs() -> tuple[torch.Tensor, ...]:
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 2, 128, dtype=torch.bfloat16)
    block_tables = torch.zeros(2, 4, dtype=torch.int32)
    seq_lens = torch.ones(2, dtype=torch.int32)
    return q, cache, cache.clone(), block_tables, seq_lens


def test_decode_passes_num_splits_and_dependent_launch_to_the_kernel(
    loaded: types.ModuleType, fake_cuda: FakeCuda
) -> None:
    parameters = inspect.signature(loaded.decode).parameters
    assert parameters["num_splits"].default is None
    assert parameters["dependent_launch"].default is False
    inputs = _decode_inputs()
    out = loaded.decode(*inputs, 0.125, 64)
    loaded.decode(*inputs, 0.125, 64, num_splits=5, dependent_launch=True)
    planned, forced = fake_cuda.decode_calls
    assert planned[0] is out and all(a is b for a, b in zip(planned[1:6], inputs))
    assert planned[6:] == (0.125, 64, 0, False)  # 0: the planned count
    assert forced[6:] == (0.125, 64, 5, True)
    with pytest.raises(ValueError, match="num_splits"):
        loaded.decode(*inputs, 0.125, 64, num_splits=0)
    assert len(fake_cuda.decode_calls) == 2


def test_the_backend_launches_decode_as_the_engine_says(fake_cuda: FakeCuda) -> None:
    """resolve_attention_backend's dependent_launch reaches the decode kernel's launch."""
    fake_cuda.build()
    q, k_cache, v_cache, block_tables, seq_lens = _decode_inputs()
    metadata = build_attention_metadata(torch.ones(2, dtype=torch.int64), seq_lens.long(),
                                        block_tables, torch.zeros(2, dtype=torch.int64), 16,
                                        torch.device("cpu"))  # fmt: skip
    for dependent_launch in (False, True):
        backend = resolve_attention_backend("cuda", dependent_launch=dependent_launch)
        backend.attend(q, k_cache, v_cache, metadata, 0.125, 1.0, 1.0)
    assert [call[-1] for call in fake_cuda.decode_calls] == [False, True]


def test_planned_num_splits_asks_the_extension(
    loaded: types.ModuleType, fake_cuda: FakeCuda
) -> None:
    assert loaded.planned_num_splits(4, 8, 4096, 128, 4, torch.bfloat16) == 7
    assert fake_cuda.plan_calls == [(4, 8, 4096, 128, 4, torch.bfloat16)]


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found is None and Path("/usr/local/cuda/bin/nvcc").is_file():
        found = "/usr/local/cuda/bin/nvcc"
    return found


SPLITS_HARNESS = r"""
#include <cstdio>

#include "paged_attention_decode.cuh"

namespace pd = pagedserve_decode;

int main() {
  const long long cases[][3] = {CASES};
  for (const auto& c : cases) {
    const pd::SplitPlan p = pd::fixed_splits(c[0], static_cast<int>(c[1]), c[2]);
    std::printf("%d %d\n", p.num_splits, p.keys_per_split);
  }
  const pd::SplitPlan p = pd::plan_with_splits<__nv_bfloat16, 128, 4>(4096, 6);
  std::printf("%d %d\n", p.num_splits, p.keys_per_split);
  return 0;
}
"""


REQUEST_SPLITS_HARNESS = r"""
#include <cstdio>

#include "paged_attention_decode.cuh"

namespace pd = pagedserve_decode;

int main() {
  const int seq_lens[] = {SEQ_LENS};
  const pd::SplitPlan plan = pd::fixed_splits(4096, 32, 32);  // CUDA graphs plan for 4096 keys
  pd::Params p{};
  p.num_splits = plan.num_splits;
  p.keys_per_split = plan.keys_per_split;
  p.split_tile = 32;
  for (const int seq_len : seq_lens) {
    std::printf("%d %d\n", seq_len, pd::request_keys_per_split(seq_len, p));
  }
  return 0;
}
"""


@pytest.mark.skipif(_nvcc() is None, reason="needs nvcc (host code only, no GPU)")
def test_a_short_context_spreads_over_every_split(tmp_path: Path) -> None:
    """With splits planned for 4,096 keys (32 splits of 128), a request's keys per split follow
    its own context: whole 32-key tiles, at most the planned 128, and as many splits at work as
    its tiles allow; the splits (the last one running to the end) cover its keys exactly once."""
    seq_lens = [0, 1, 31, 32, 33, 256, 1000, 1024, 4000, 4096]
    source = REQUEST_SPLITS_HARNESS.replace("SEQ_LENS", ", ".join(map(str, seq_lens)))
    (tmp_path / "harness.cu").write_text(source)
    binary = tmp_path / "harness"
    compile_cmd = [_nvcc(), "-std=c++17", f"-I{CSRC}", str(tmp_path / "harness.cu")]
    subprocess.run([*compile_cmd, "-o", str(binary)], check=True, timeout=300)
    out = subprocess.run([binary], check=True, capture_output=True, text=True).stdout
    keys = {int(a): int(b) for a, b in (line.split() for line in out.splitlines())}
    num_splits = 32
    for seq_len, per_split in keys.items():
        assert per_split % 32 == 0 and 32 <= per_split <= 128, (seq_len, per_split)
        spans = [
            (s * per_split, seq_len if s == num_splits - 1 else min(seq_len, (s + 1) * per_split))
            for s in range(num_splits)
        ]
        covered = [k for begin, end in spans for k in range(begin, end)]
        assert covered == list(range(seq_len)), seq_len
        working = sum(end > begin for begin, end in spans)
        assert working == min(num_splits, -(-seq_len // 32)), (seq_len, working)
    assert keys[256] == 32 and keys[1000] == 32 and keys[4096] == 128


@pytest.mark.skipif(_nvcc() is None, reason="needs nvcc (host code only, no GPU)")
def test_split_override_is_clamped_to_whole_tiles(tmp_path: Path) -> None:
    """fixed_splits (max_seq_len, tile, requested) -> (splits, keys a split): at least one, at
    most min(tiles, 128) splits, whole tiles each, counted as ceil(tiles / tiles a split)."""
    expected = {
        (4096, 32, 6): (6, 704),  # 128 tiles: 22 a split
        (320, 32, 6): (5, 64),  # 10 tiles: 2 a split make 5 splits
        (4096, 32, 1000): (128, 32),  # at most one split a tile
        (32768, 32, 1000): (128, 256),  # at most 128 splits (the reduce kernel's limit)
        (4096, 32, 0): (1, 4096),
        (4096, 32, -3): (1, 4096),
        (1, 32, 4): (1, 32),
        (100, 16, 3): (3, 48),  # 7 tiles: 3 a split
    }
    cases = ", ".join("{" + ", ".join(map(str, case)) + "}" for case in expected)
    (tmp_path / "harness.cu").write_text(SPLITS_HARNESS.replace("CASES", cases))
    binary = tmp_path / "harness"
    compile_cmd = [_nvcc(), "-std=c++17", f"-I{CSRC}", str(tmp_path / "harness.cu")]
    subprocess.run([*compile_cmd, "-o", str(binary)], check=True, timeout=300)
    lines = subprocess.run([binary], check=True, capture_output=True, text=True).stdout.split("\n")
    got = [tuple(int(x) for x in line.split()) for line in lines if line]
    # bf16, head_dim 128, group 4: 32-key tiles, as the first case
    assert got == [*expected.values(), (6, 704)]


def test_an_arch_list_with_the_a_suffix_builds_what_the_engine_loads(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TORCH_CUDA_ARCH_LIST="9.0a" (as GPU images set it) builds the library that an sm_90
    device loads, not an sm_90a one that nothing looks for."""
    from pagedserve.kernels import build

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr("torch.utils.cpp_extension.CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    assert build.cuda_archs([]) == (["80", "90"], "")
    assert cuda_attention.device_arch() == "90"
