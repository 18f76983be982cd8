"""The CUDA quantized GEMV (csrc/quant_gemv*, kernels.cuda_quant) on a machine without a GPU.

Without CUDA, or without a library built for these sources, `load_extension` raises ImportError
(it never compiles) and the quantized layers keep Triton's GEMV. With torch's CUDA queries, the
compile and the extension loader replaced by fakes, the build side is checked too: the spec's
sources, flags and cache key, kernels.build's jobs per architecture, the import of a built
library. The launcher's operand checks and launch plans are pure Python; with nvcc, the device
units compile for sm_90 and the header's shared-memory size agrees with the planner's. The
kernel's results are checked on a GPU by scripts/gpu/check_quant_cuda.py.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import logging
import re
import shutil
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagedserve.kernels import build, cuda_quant, cuda_quant_plan, extensions

CSRC = Path(__file__).resolve().parents[1] / "csrc"


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found is None and Path("/usr/local/cuda/bin/nvcc").is_file():
        found = "/usr/local/cuda/bin/nvcc"
    return found


# ------------------------------------------------------------------ loading without a GPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine may have it built")
def test_load_fails_cleanly_without_cuda(caplog: pytest.LogCaptureFixture) -> None:
    cuda_quant.load_extension.cache_clear()
    with pytest.raises(ImportError, match="CUDA device"):
        cuda_quant.load_extension()
    with caplog.at_level(logging.WARNING):
        assert not cuda_quant.available()
    [record] = caplog.records
    assert "CUDA quantized GEMV unavailable" in record.getMessage()


class FakeSm90:
    """An sm_90 machine as far as the build and load code can tell: the compile and the
    extension loader replaced, recording what they are asked."""

    def __init__(self, built_dir: Path) -> None:
        self.built_dir = built_dir
        self.loads: list[dict] = []
        self.imported: list[str] = []

    def run_compile(self, command: list[str], env: dict[str, str], timeout_s: float) -> None:
        kwargs = json.loads(command[-1])
        self.loads.append({**kwargs, "arch_list": env.get("TORCH_CUDA_ARCH_LIST")})
        (Path(kwargs["build_directory"]) / f"{kwargs['name']}.so").write_bytes(b"\x7fELF")

    def loader_class(self) -> type:
        fake = self

        class Loader(importlib.abc.Loader):
            def __init__(self, name: str, path: str) -> None:
                self.name = name

            def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
                fake.imported.append(self.name)
                return types.ModuleType(self.name)

            def exec_module(self, module: types.ModuleType) -> None:
                pass

        return Loader


@pytest.fixture
def fake_sm90(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeSm90]:
    fake = FakeSm90(tmp_path / "built")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(extensions, "BUILT_DIR", fake.built_dir)
    monkeypatch.setattr(extensions, "run_compile", fake.run_compile)
    monkeypatch.setattr(importlib.machinery, "ExtensionFileLoader", fake.loader_class())
    cuda_quant.load_extension.cache_clear()
    yield fake
    cuda_quant.load_extension.cache_clear()


def test_unbuilt_kernel_says_how_to_build_and_nothing_compiles(fake_sm90: FakeSm90) -> None:
    with pytest.raises(ImportError, match="python -m pagedserve.kernels.build"):
        cuda_quant.load_extension()
    assert fake_sm90.loads == []


def test_a_build_compiles_the_binding_and_every_unit_for_the_arch(fake_sm90: FakeSm90) -> None:
    spec = cuda_quant.cuda_quant_spec("90")
    library = extensions.build(spec, fake_sm90.built_dir)
    [kwargs] = fake_sm90.loads
    units = sorted(p.name for p in CSRC.glob("quant_gemv*") if p.suffix in (".cu", ".cpp"))
    assert sorted(Path(s).name for s in kwargs["sources"]) == units
    assert len(units) == 1 + len(cuda_quant.SCHEMES) * len(cuda_quant.DTYPES)
    assert "-gencode=arch=compute_90,code=sm_90" in kwargs["extra_cuda_cflags"]
    assert kwargs["arch_list"] == "9.0" and kwargs["is_python_module"]
    assert library.name == f"{spec.name}.so" and spec.name.startswith("pagedserve_quant_gemv_sm90_")
    cuda_quant.load_extension()
    assert fake_sm90.imported == [spec.name]


def test_an_older_device_is_refused_before_any_lookup(
    fake_sm90: FakeSm90, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ImportError, match="sm_90 or later, not sm_80"):
        cuda_quant.load_extension()
    with pytest.raises(ValueError, match="sm_90"):
        cuda_quant.cuda_quant_spec("80")


def test_kernels_build_adds_the_gemv_from_sm_90_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    built: list[str] = []
    monkeypatch.setattr(build, "cpu_can_run_kernels", lambda: False)
    monkeypatch.setattr(build, "cuda_archs", lambda requested: (["80", "90"], ""))
    monkeypatch.setattr(build, "_build_one", lambda label, spec, out: built.append(label) or True)
    assert build.build_all(tmp_path, [])
    assert built == [
        "CUDA decode kernel (sm_80)",
        "CUDA decode kernel (sm_90)",
        "CUDA quantized GEMV (sm_90)",
    ]
    assert "CUDA quantized GEMV (sm_80): skipped (needs sm_90+" in capsys.readouterr().out


def test_without_cuda_the_build_skips_the_gemv_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(build, "cpu_can_run_kernels", lambda: False)
    monkeypatch.setattr(build, "cuda_archs", lambda requested: ([], "this torch has no CUDA"))
    assert build.build_all(tmp_path, [])
    assert "CUDA quantized GEMV: skipped (this torch has no CUDA" in capsys.readouterr().out


# ------------------------------------------------------------------ the cache key


def test_build_inputs_are_the_gemv_files_of_csrc() -> None:
    inputs = {path.name for path in cuda_quant.build_inputs()}
    # its own files and the header of programmatic dependent launches it shares
    assert inputs == {path.name for path in CSRC.glob("quant_gemv*")} | {"grid_dependency.h"}


def test_name_changes_with_every_build_input_flag_and_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    monkeypatch.setattr(cuda_quant, "CSRC_DIR", csrc)

    def name() -> str:
        return cuda_quant.cuda_quant_spec("90").name

    base = name()
    for path in cuda_quant.build_inputs():
        text = path.read_text()
        path.write_text(text + "\n// edited\n")
        assert name() != base, path.name
        path.write_text(text)
    assert name() == base
    with monkeypatch.context() as patch:
        patch.setattr(cuda_quant, "CXX_FLAGS", ("-O2",))
        assert name() != base
    with monkeypatch.context() as patch:
        patch.setattr(torch, "__version__", "0.0.0")
        assert name() != base
    assert cuda_quant.cuda_quant_spec("100").name != base.replace("sm90", "sm100")


def test_only_the_binding_reads_torch_and_defines_the_module() -> None:
    binding = CSRC / cuda_quant.BINDING
    torch_include = re.compile(r"#include <(torch|ATen|c10)/")
    for path in cuda_quant.build_inputs():
        text = path.read_text()
        assert ("PYBIND11_MODULE(" in text) == (path == binding), path.name
        assert bool(torch_include.search(text)) == (path == binding), path.name
    assert '#include "quant_gemv.cuh"' not in binding.read_text()


def test_units_instantiate_every_scheme_and_dtype() -> None:
    types_ = {"bf16": "__nv_bfloat16", "fp16": "__half"}
    schemes = {"int4": "kInt4", "int8": "kInt8", "fp8": "kFp8"}
    for scheme in cuda_quant.SCHEMES:
        for dtype in cuda_quant.DTYPES:
            tag = cuda_quant.DTYPE_TAGS[dtype]
            unit = (CSRC / f"quant_gemv_{scheme}_{tag}.cu").read_text()
            assert f"PAGEDSERVE_QUANT_INSTANTIATE({schemes[scheme]}, {types_[tag]})" in unit


def test_python_constants_are_the_headers() -> None:
    header = (CSRC / "quant_gemv.h").read_text()
    plan = cuda_quant_plan
    for name, value in (("kMaxRows", plan.MAX_ROWS), ("kStepK", plan.STEP_K),
                        ("kTileN", plan.TILE_N), ("kMaxSplits", plan.MAX_SPLITS),
                        ("kMaxWarps", plan.MAX_WARPS), ("kXRowPad", plan.X_ROW_PAD)):  # fmt: skip
        assert re.search(rf"constexpr int {name} = {value};", header), name
