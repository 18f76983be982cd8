"""The CUDA quantized GEMV's launcher (kernels.cuda_quant) without a GPU: its operand checks
(each says what does not fit, before anything loads), its launch plans at real model shapes,
and, with nvcc, the device units compiled for sm_90 (no register spills in the default
configs) and the header's shared-memory size against the planner's."""

from __future__ import annotations

import re
import shutil
import subprocess
import types
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.kernels import cuda_quant, cuda_quant_plan, extensions, quant_ref, triton_quant
from pagedserve.kernels.cuda_quant_plan import GemvConfig
from pagedserve.kernels.quant_ref import FP8_DTYPE, IntWeight
from pagedserve.models import loader
from pagedserve.models.layer_config import LayerConfig, TensorParallel
from pagedserve.models.model_config import ModelConfig
from pagedserve.models.quantization.config import Fp8Scheme, IntScheme
from pagedserve.models.quantization.fp8 import Fp8LinearMethod
from pagedserve.models.quantization.int_weight import IntWeightLinearMethod

CSRC = Path(__file__).resolve().parents[1] / "csrc"
LLAMA = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
QWEN3 = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found is None and Path("/usr/local/cuda/bin/nvcc").is_file():
        found = "/usr/local/cuda/bin/nvcc"
    return found


def _int_weight(n: int = 64, k: int = 256, bits: int = 4, group: int = 128) -> IntWeight:
    w = torch.randn(n, k)
    return quant_ref.quantize_int_weight(w, bits, group, symmetric=False)


def _bf16(weight: IntWeight) -> IntWeight:
    return IntWeight(weight.qweight, weight.scales.bfloat16(), weight.zeros.bfloat16(),
                     weight.bits, weight.group_size, weight.perm)  # fmt: skip


def _x(m: int = 1, k: int = 256, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(m, k).to(dtype)


# ------------------------------------------------------------------ operand checks


def test_valid_int_operands_only_lack_a_cuda_device() -> None:
    weight = _bf16(_int_weight())
    assert cuda_quant.int_weight_problem(_x(), weight) == (
        "the operands must be CUDA tensors on one device"
    )
    with pytest.raises(ValueError, match="CUDA tensors"):
        cuda_quant.int_weight_gemv(_x(), weight)


def _x_fp32(x, w, b):  # noqa: ANN001, ANN202 (the cases below)
    return x.float(), w, b


def _17_rows(x, w, b):  # noqa: ANN001, ANN202
    return _x(17), w, b


def _short_x(x, w, b):  # noqa: ANN001, ANN202
    return x[:, :128], w, b


def _k_192(x, w, b):  # noqa: ANN001, ANN202
    return _x(k=192), _bf16(_int_weight(k=192, group=64)), b


def _group_64(x, w, b):  # noqa: ANN001, ANN202
    return x, _bf16(_int_weight(group=64)), b


def _fp32_scales(x, w, b):  # noqa: ANN001, ANN202
    return x, _int_weight(), b


def _zeros_strided(x, w, b):  # noqa: ANN001, ANN202
    return x, IntWeight(w.qweight, w.scales, w.zeros.t().contiguous().t(), 4, 128), b


def _codes_strided(x, w, b):  # noqa: ANN001, ANN202
    return x, IntWeight(w.qweight.t().contiguous().t(), w.scales, w.zeros, 4, 128), b


def _perm_int32(x, w, b):  # noqa: ANN001, ANN202
    perm = torch.arange(256, dtype=torch.int32)
    return x, IntWeight(w.qweight, w.scales, w.zeros, 4, 128, perm), b


def _bias_63(x, w, b):  # noqa: ANN001, ANN202
    return x, w, torch.zeros(63, dtype=torch.bfloat16)


def _bias_fp32(x, w, b):  # noqa: ANN001, ANN202
    return x, w, torch.zeros(64)


def _x_offset_one_element(x, w, b):  # noqa: ANN001, ANN202
    return torch.zeros(1, 264, dtype=torch.bfloat16)[:, 1:257], w, b


def _x_stride_not_16_bytes(x, w, b):  # noqa: ANN001, ANN202
    return torch.zeros(2, 260, dtype=torch.bfloat16)[:, :256], w, b


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_x_fp32, "x dtype torch.float32"),
        (_17_rows, "17 rows"),
        (_short_x, r"x must be \[..., 256\]"),
        (_k_192, "K = 192"),
        (_group_64, "group size 64"),
        (_fp32_scales, "scales and zeros must be x's dtype"),
        (_zeros_strided, "the same strides"),
        (_codes_strided, "weight rows must be contiguous"),
        (_perm_int32, "perm must be int64"),
        (_bias_63, r"bias must be \[64\]"),
        (_bias_fp32, "bias must be"),
        (_x_offset_one_element, "x rows must be 16-byte aligned"),
        (_x_stride_not_16_bytes, "x rows must be 16-byte aligned"),
    ],
)
def test_int_operands_the_kernel_does_not_take(change: object, message: str) -> None:
    x, weight, bias = change(_x(), _bf16(_int_weight()), None)  # type: ignore[operator]
    problem = cuda_quant.int_weight_problem(x, weight, bias)
    assert problem is not None and re.search(message, problem), problem
    with pytest.raises(ValueError, match=message):
        cuda_quant.int_weight_gemv(x, weight, bias)
    assert not cuda_quant.int_weight_supported(x, weight, bias)


def test_a_permuted_x_needs_no_alignment() -> None:
    weight = _bf16(_int_weight())
    weight.perm = torch.randperm(256)
    x = torch.zeros(1, 260, dtype=torch.bfloat16)[:, 1:257]
    assert cuda_quant.int_weight_problem(x, weight) == (
        "the operands must be CUDA tensors on one device"
    )


def test_int8_codes_are_checked_as_bytes() -> None:
    weight = _int_weight(bits=8)
    weight = IntWeight(weight.qweight.to(torch.int32), weight.scales, weight.zeros, 8, 128)
    assert "qweight must be torch.uint8" in cuda_quant.int_weight_problem(_x(dtype=torch.float16),
                                                                          weight)  # fmt: skip


def _fp8(n: int = 64, k: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    wq, scale = quant_ref.quantize_fp8_rows(torch.randn(n, k))
    return wq, scale.squeeze(1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda x, wq, s: (x, wq, s), "CUDA tensors"),
        (lambda x, wq, s: (x, wq.float(), s), "wq must be float8_e4m3fn"),
        (lambda x, wq, s: (x, wq, s.bfloat16()), r"w_scale must be float32 \[64\]"),
        (lambda x, wq, s: (x, wq, s[:32]), "w_scale must be"),
        (lambda x, wq, s: (_x(2, 128), wq, s), r"x must be \[..., 256\]"),
        (
            lambda x, wq, s: (x.half(), torch.zeros(64, 264, dtype=FP8_DTYPE)[:, 8:], s),
            "weight rows must be contiguous and 16-byte aligned",
        ),  # fmt: skip
    ],
)
def test_fp8_operand_checks(change: object, message: str) -> None:
    x, wq, scale = change(_x(4), *_fp8())  # type: ignore[operator]
    problem = cuda_quant.fp8_weight_problem(x, wq, scale)
    assert problem is not None and re.search(message, problem), problem
    with pytest.raises(ValueError, match=message):
        cuda_quant.fp8_weight_gemv(x, wq, scale)


# ------------------------------------------------------------------ launch plans


@pytest.mark.parametrize("scheme", cuda_quant.SCHEMES)
@pytest.mark.parametrize("m", [1, 2, 4, 8, 9, 16])
def test_plans_tile_k_and_fit_at_model_shapes(scheme: str, m: int) -> None:
    for n, k in (*LLAMA, *QWEN3):
        plan = cuda_quant_plan.plan_gemv(scheme, m, n, k, 132, cuda_quant_plan.DEFAULTS[scheme])
        assert plan is not None, (n, k)
        assert 1 <= plan.splits <= cuda_quant_plan.MAX_SPLITS
        assert plan.k_per_split % cuda_quant_plan.STEP_K == 0
        assert plan.splits * plan.k_per_split >= k > (plan.splits - 1) * plan.k_per_split
        assert plan.shared_bytes <= cuda_quant_plan.AUTO_SHARED_BYTES, (n, k, plan)
        assert plan.shared_bytes == cuda_quant_plan.shared_bytes(scheme, m, plan.k_per_split,
                                                             plan.warps, plan.splits)  # fmt: skip
        warps = -(-n // cuda_quant_plan.TILE_N) * plan.splits
        # enough warps for the SMs, unless K has no more steps to split or 8 is the limit
        assert warps >= 132 * 8 or plan.splits == min(8, k // cuda_quant_plan.STEP_K), (n, k, plan)


def test_the_tuned_configs_launch() -> None:
    """Every QUANT_CUDA_TUNED entry is a valid config with a plan for its bucket's largest M,
    and the planner takes it for that shape."""
    for (sms, scheme, bucket, n, k), config in cuda_quant_plan.QUANT_CUDA_TUNED.items():
        cuda_quant_plan.check_config(config)
        assert cuda_quant_plan.plan_gemv(scheme, bucket, n, k, sms) == cuda_quant_plan.plan_gemv(
            scheme, bucket, n, k, sms, config
        )
        assert cuda_quant_plan.plan_gemv(scheme, bucket, n, k, sms) is not None


def test_a_forced_config_is_the_launch() -> None:
    plan = cuda_quant_plan.plan_gemv("int4", 1, 4096, 14336, 132, GemvConfig(8, 3, 2))
    assert (plan.warps, plan.splits, plan.k_per_split, plan.unroll) == (8, 3, 4864, 2)
    # more splits than steps: one a step
    plan = cuda_quant_plan.plan_gemv("fp8", 1, 1024, 256, 132, GemvConfig(4, 8, 4))
    assert (plan.splits, plan.k_per_split) == (2, 128)
    with pytest.raises(ValueError, match="unroll 2 or 4"):
        cuda_quant_plan.plan_gemv("fp8", 1, 1024, 256, 132, GemvConfig(4, 1, 3))
    with pytest.raises(ValueError, match="splits 1..8"):
        cuda_quant_plan.plan_gemv("fp8", 1, 1024, 256, 132, GemvConfig(4, 9, 2))


def test_no_plan_when_the_staged_x_cannot_fit() -> None:
    """16 rows of K = 65536 split 8 ways: 16 x 8192 x 2 bytes of x in a CTA, over the limit."""
    assert cuda_quant_plan.plan_gemv("int4", 16, 4096, 65536, 132) is None
    assert cuda_quant_plan.plan_gemv("int4", 1, 4096, 65536, 132) is not None


# ------------------------------------------------------------------ nvcc


SHARED_HARNESS = r"""
#include <cstdio>

#include "quant_gemv.h"

namespace pq = pagedserve_quant;

int main() {
  const int cases[][5] = {CASES};
  for (const auto& c : cases)
    std::printf("%lld\n", static_cast<long long>(pq::shared_bytes(
        static_cast<pq::Scheme>(c[0]), c[1], c[2], c[3], c[4])));
  return 0;
}
"""


@pytest.mark.skipif(_nvcc() is None, reason="needs nvcc (host code only, no GPU)")
def test_the_headers_shared_bytes_are_the_planners(tmp_path: Path) -> None:
    cases = [(s, m, kps, w, splits) for s in range(3) for m in (1, 8, 9, 16)
             for kps in (128, 1792) for w in (1, 8) for splits in (1, 2)]  # fmt: skip
    body = ", ".join("{" + ", ".join(map(str, c)) + "}" for c in cases)
    (tmp_path / "harness.cu").write_text(SHARED_HARNESS.replace("CASES", body))
    binary = tmp_path / "harness"
    command = [_nvcc(), "-std=c++17", f"-I{CSRC}", str(tmp_path / "harness.cu"), "-o", str(binary)]
    subprocess.run(command, check=True, timeout=300)
    lines = subprocess.run([binary], check=True, capture_output=True, text=True).stdout.split()
    schemes = ("int4", "int8", "fp8")  # the order of pagedserve_quant::Scheme
    expected = [cuda_quant_plan.shared_bytes(schemes[s], *rest) for s, *rest in cases]
    assert [int(line) for line in lines] == expected


def _compile_unit(unit: str, out: Path) -> str:
    command = [_nvcc(), "-std=c++17", *extensions.nvcc_flags("90"), "-Xptxas", "-v",
               f"-I{CSRC}", "-c", str(CSRC / unit), "-o", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr


@pytest.mark.skipif(_nvcc() is None, reason="needs nvcc (no GPU)")
def test_every_unit_compiles_for_sm_90_without_spills_in_the_defaults(tmp_path: Path) -> None:
    """Each scheme x dtype unit compiles for sm_90; ptxas reports no spill stores for the
    kernels of the default unroll (int4: 4, 8-bit codes: 2), at M <= 8 and M > 8."""
    units = cuda_quant.source_names()[1:]
    with ThreadPoolExecutor(2) as pool:
        reports = list(pool.map(lambda u: _compile_unit(u, tmp_path / f"{u}.o"), units))
    for unit, report in zip(units, reports):
        scheme = unit.split("_")[2]
        unroll = cuda_quant_plan.DEFAULTS[scheme].unroll
        # ptxas: "Compiling entry function '<mangled ..., MT, UNROLL>' ... N bytes spill stores"
        kernels = re.findall(r"Compiling entry function '(\S+)'.*?(\d+) bytes spill stores",
                             report, re.S)  # fmt: skip
        assert len(kernels) == 4, unit  # M tiles 1, 2 x unroll 2, 4
        for name, spilled in kernels:
            if name.endswith(f"ELi{unroll}EEEvNS_6ParamsE"):
                assert spilled == "0", (unit, name)


# ------------------------------------------------------------------ the linear methods' choice


def _layer_config(cuda_quant_gemv: bool, dependent_launch: bool = False) -> LayerConfig:
    return LayerConfig(torch.device("cpu"), torch.bfloat16, attention=None, fused_ops="triton",
                       cuda_quant_gemv=cuda_quant_gemv,
                       dependent_launch=dependent_launch)  # type: ignore[arg-type]  # fmt: skip


def _recorder(calls: list, tag: str) -> Callable[..., None]:
    """A stand-in GEMV that records (tag, its dependent_launch)."""

    def gemv(*operands: object, dependent_launch: bool = False) -> None:
        calls.append((tag, dependent_launch))

    return gemv


@pytest.mark.parametrize(("enabled", "takes"), [(True, True), (True, False), (False, True)])
def test_int_layers_run_the_cuda_gemv_where_enabled_and_taken(
    monkeypatch: pytest.MonkeyPatch, enabled: bool, takes: bool
) -> None:
    """cuda_quant_gemv on and operands the kernel takes: the CUDA GEMV; otherwise Triton's;
    either launched as the config's dependent_launch says."""
    calls: list[tuple[str, bool]] = []
    monkeypatch.setattr(cuda_quant, "int_weight_supported", lambda x, w, b: takes)
    for module, tag in ((cuda_quant, "cuda"), (triton_quant, "triton")):
        monkeypatch.setattr(module, "int_weight_gemv", _recorder(calls, tag))
    config = _layer_config(enabled, dependent_launch=True)
    method = IntWeightLinearMethod(IntScheme(4, 128, False, "float"), config)
    method.group_size = 128
    w = _bf16(_int_weight())
    layer = types.SimpleNamespace(qweight=w.qweight, scales=w.scales, zeros=w.zeros, perm=None)
    method.apply(layer, _x(), None)  # type: ignore[arg-type]
    assert calls == [("cuda" if enabled and takes else "triton", True)]


@pytest.mark.parametrize(("enabled", "takes"), [(True, True), (True, False), (False, True)])
def test_fp8_layers_run_the_cuda_gemv_where_enabled_and_taken(
    monkeypatch: pytest.MonkeyPatch, enabled: bool, takes: bool
) -> None:
    """As for the integer schemes, except that Triton's fp8 GEMV is never a programmatic
    dependent (it measured slower as one)."""
    monkeypatch.setattr(cuda_quant, "ENGINE_SCHEMES", frozenset(cuda_quant.SCHEMES))
    calls: list[tuple[str, bool]] = []
    monkeypatch.setattr(cuda_quant, "fp8_weight_supported", lambda x, wq, s, b: takes)
    for module, tag in ((cuda_quant, "cuda"), (triton_quant, "triton")):
        monkeypatch.setattr(module, "fp8_weight_gemv", _recorder(calls, tag))
    method = Fp8LinearMethod(Fp8Scheme("float"), _layer_config(enabled, dependent_launch=True))
    wq, scale = _fp8()
    method.apply(types.SimpleNamespace(qweight=wq, weight_scale=scale), _x(), None)  # type: ignore[arg-type]
    assert calls == [("cuda", True) if enabled and takes else ("triton", False)]


def test_the_engine_takes_the_cuda_gemv_for_the_integer_schemes_only() -> None:
    """What measured fastest in the engine (W3): int4 / int8 on the CUDA GEMV, fp8 on Triton's."""
    assert cuda_quant.engine_takes("int4") and cuda_quant.engine_takes("int8")
    assert not cuda_quant.engine_takes("fp8")
    with pytest.raises(ValueError, match="unknown scheme"):
        cuda_quant.engine_takes("int3")


@pytest.mark.parametrize("bits", [4, 8])
def test_schemes_the_engine_does_not_take_run_triton(
    monkeypatch: pytest.MonkeyPatch, bits: int
) -> None:
    """Enabled and taken, but outside ENGINE_SCHEMES: Triton's GEMV (fp8 by default)."""
    monkeypatch.setattr(cuda_quant, "ENGINE_SCHEMES", frozenset({"int4", "int8"} - {f"int{bits}"}))
    monkeypatch.setattr(cuda_quant, "int_weight_supported", lambda x, w, b: True)
    monkeypatch.setattr(cuda_quant, "fp8_weight_supported", lambda x, wq, s, b: True)
    calls: list[str] = []
    for module in (cuda_quant, triton_quant):
        tag = "cuda" if module is cuda_quant else "triton"
        monkeypatch.setattr(module, "int_weight_gemv", _recorder(calls, tag))
        monkeypatch.setattr(module, "fp8_weight_gemv", _recorder(calls, tag))
    method = IntWeightLinearMethod(IntScheme(bits, 128, False, "float"), _layer_config(True))
    method.group_size = 128
    w = _bf16(_int_weight(bits=bits))
    layer = types.SimpleNamespace(qweight=w.qweight, scales=w.scales, zeros=w.zeros, perm=None)
    method.apply(layer, _x(), None)  # type: ignore[arg-type]
    wq, scale = _fp8()
    fp8_layer = types.SimpleNamespace(qweight=wq, weight_scale=scale)
    fp8 = Fp8LinearMethod(Fp8Scheme("float"), _layer_config(True))
    fp8.apply(fp8_layer, _x(), None)  # type: ignore[arg-type]
    assert calls == [("triton", False), ("triton", False)]


def test_the_loader_enables_the_cuda_gemv_only_for_quantized_cuda_models(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """build_layer_config: CUDA, quantized, the option on and the kernel available."""
    monkeypatch.setattr(cuda_quant, "available", lambda: True)
    monkeypatch.setattr(loader, "_triton_importable", lambda: True)
    monkeypatch.setattr(loader, "resolve_attention_backend", lambda *args, **kwargs: None)
    monkeypatch.setattr(loader, "check_supported", lambda *args: None)
    hf_config = ModelConfig({"dtype": "bfloat16", "quantization_config": None})
    cuda = torch.device("cuda")

    def built(quantization: str | None, device: torch.device = cuda, **kw: object) -> bool:
        config = EngineConfig(model="x", quantization=quantization, **kw)  # type: ignore[arg-type]
        return loader.build_layer_config(
            config, hf_config, device, TensorParallel()
        ).cuda_quant_gemv

    assert built("fp8") and built("int8")
    assert not built(None)
    assert not built("fp8", cuda_quant_gemv=False)
    assert not built("fp8", torch.device("cpu"))
    monkeypatch.setattr(cuda_quant, "available", lambda: False)
    assert not built("fp8")
