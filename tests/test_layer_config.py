"""The loader decides how the layers run once (LayerConfig) and the layers keep its decisions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.models.layers import Attention, RMSNorm, SiluAndMul
from pagedserve.models.linear import LinearBase, LMHead
from pagedserve.models.loader import build_layer_config, load_model
from pagedserve.models.model_config import load_model_config
from tests.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"), seed=0, hidden_size=64)


def test_cpu_decisions(model_dir: Path) -> None:
    """CPU: float32, no Triton, no small-batch GEMM; the C++ kernels only when asked for and
    loaded; the attention backend the config names."""
    hf = load_model_config(str(model_dir))
    cpu = torch.device("cpu")
    plain = build_layer_config(EngineConfig(model=str(model_dir), cpu_kernels=False), hf, cpu)
    assert (plain.dtype, plain.fused_ops, plain.small_batch_gemm) == (torch.float32, "torch", False)
    assert plain.attention.name == "torch" and plain.attention.head_major
    assert (plain.tp.rank, plain.tp.size) == (0, 1)
    ref = build_layer_config(
        EngineConfig(model=str(model_dir), attention_backend="torch_ref"), hf, cpu
    )
    assert ref.attention.name == "torch_ref" and not ref.attention.head_major
    bf16 = build_layer_config(EngineConfig(model=str(model_dir), dtype="bfloat16"), hf, cpu)
    assert bf16.fused_ops == "torch"  # the C++ kernels are float32 only


def test_cuda_decisions_without_a_gpu(model_dir: Path) -> None:
    """Asked for a CUDA device (decisions only; nothing runs): Triton's fused ops, the small
    batch GEMM for bf16 only and when the config allows it; the cuda backend falls back."""
    hf = load_model_config(str(model_dir))
    cuda = torch.device("cuda")
    triton = EngineConfig(model=str(model_dir), attention_backend="triton")
    on = build_layer_config(triton, hf, cuda)
    assert (on.dtype, on.fused_ops, on.small_batch_gemm) == (torch.bfloat16, "triton", True)
    assert on.attention.name == "triton" and on.attention.fuses_kv_write
    assert on.attention.graph_safe
    fp32 = EngineConfig(model=str(model_dir), attention_backend="triton", dtype="float32")
    assert not build_layer_config(fp32, hf, cuda).small_batch_gemm
    off = EngineConfig(model=str(model_dir), attention_backend="triton", small_batch_gemm=False)
    assert not build_layer_config(off, hf, cuda).small_batch_gemm
    assert on.small_batch_gemm_rows == 1  # batch-1 decode only, by default
    nine = EngineConfig(model=str(model_dir), attention_backend="triton", small_batch_gemm_rows=9)
    assert build_layer_config(nine, hf, cuda).small_batch_gemm_rows == 9
    for rows in (0, 17):
        with pytest.raises(ValueError, match="small_batch_gemm_rows"):
            EngineConfig(model=str(model_dir), small_batch_gemm_rows=rows)


def test_layers_keep_the_loaders_decisions(model_dir: Path) -> None:
    config = EngineConfig(model=str(model_dir), attention_backend="torch_ref", cpu_kernels=False)
    model = load_model(config, torch.device("cpu"))
    layer_config = model.layer_config
    modules = list(model.modules())
    assert all(m.fused_ops == "torch" for m in modules if isinstance(m, RMSNorm | SiluAndMul))
    attention = [m for m in modules if isinstance(m, Attention)]
    assert len(attention) == 2 and all(m.backend is layer_config.attention for m in attention)
    assert not any(m.fuses_kv_write for m in attention)
    linears = [m for m in modules if isinstance(m, LinearBase | LMHead)]
    assert all(m.tp is layer_config.tp for m in linears)


@pytest.mark.parametrize(
    ("capability", "enabled", "expected"),
    [((9, 0), True, True), ((10, 0), True, True), ((8, 0), True, False), ((9, 0), False, False)],
)
def test_dependent_launch_only_on_hopper_and_later(
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capability: tuple[int, int],
    enabled: bool,
    expected: bool,
) -> None:
    """Programmatic dependent launch: the Triton path on a visible GPU of compute capability
    9.0 or more, when the config allows it; the layers and the attention backend get it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    hf = load_model_config(str(model_dir))
    config = EngineConfig(model=str(model_dir), attention_backend="triton",
                          dependent_launch=enabled)  # fmt: skip
    layer_config = build_layer_config(config, hf, torch.device("cuda"))
    assert layer_config.dependent_launch is expected
    assert RMSNorm(8, 1e-6, layer_config).dependent_launch is expected
    assert SiluAndMul(layer_config).dependent_launch is expected
    assert not build_layer_config(config, hf, torch.device("cpu")).dependent_launch


@pytest.mark.skipif(torch.cuda.is_available(), reason="decisions of a machine without a GPU")
def test_no_dependent_launch_without_a_gpu(model_dir: Path) -> None:
    hf = load_model_config(str(model_dir))
    config = EngineConfig(model=str(model_dir), attention_backend="triton")
    assert config.dependent_launch  # on by default
    assert not build_layer_config(config, hf, torch.device("cuda")).dependent_launch
