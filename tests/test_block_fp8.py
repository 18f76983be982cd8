"""Block-wise FP8 checkpoints (Qwen's and DeepSeek's FP8 releases: `weight_block_size`,
`weight_scale_inv` per block of weights): the engine dequantizes each block and quantizes the
weight again per output channel at load, so each weight it computes with is the checkpoint's
within one more fp8 rounding."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.models.layer_config import TensorParallel
from pagedserve.models.linear import LinearBase
from pagedserve.models.loader import build_layer_config, load_model
from pagedserve.models.model_config import load_model_config
from pagedserve.models.quantization.config import QuantizationError
from pagedserve.models.scoring import token_logprobs
from tests import quant_checkpoints as qc
from tests.test_quant_checkpoints import effective_weight, expected_weight, shard
from tests.tiny_models import save_tiny_model

CPU = torch.device("cpu")
FP8_ROUNDING = 2**-4  # E4M3's largest relative rounding error (3 mantissa bits)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """(the float model, its block-wise FP8 checkpoint with 32 x 32 blocks, the dequantized
    weight of each tensor)."""
    root = tmp_path_factory.mktemp("block_fp8")
    float_model = save_tiny_model("llama", root / "float", seed=3, hidden_size=128)
    expected = qc.write_block_fp8(float_model, root / "fp8", block=(32, 32))
    return float_model, root / "fp8", expected


def assert_within_one_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """Each weight within fp8's relative rounding of the checkpoint's, or within half the
    smallest subnormal step of its row's new scale (amax / 448)."""
    row_scale = want.abs().amax(dim=1, keepdim=True) / 448
    bound = FP8_ROUNDING * want.abs() + row_scale * 2**-10
    assert bool(((got - want).abs() <= bound).all()), float(((got - want).abs() - bound).max())


def test_each_layer_computes_with_the_checkpoints_weights(checkpoint) -> None:
    _, path, expected = checkpoint
    model = load_model(EngineConfig(model=str(path)), CPU)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}
    assert len(layers) == 8
    for name, layer in layers.items():
        assert layer.qweight.dtype == torch.float8_e4m3fn and layer.weight_scale.dim() == 1
        want = expected_weight(name, expected)
        got = effective_weight(layer)
        assert_within_one_rounding(got, want)
        assert not torch.equal(got, want)  # requantized: not bit-exact, but within a rounding


def test_tensor_parallel_ranks_load_whole_blocks(checkpoint) -> None:
    _, path, expected = checkpoint
    config = EngineConfig(model=str(path))
    hf_config = load_model_config(str(path))
    for rank in (0, 1):
        layer_config = build_layer_config(config, hf_config, CPU)
        layer_config = dataclasses.replace(layer_config, tp=TensorParallel(rank, 2))
        model = load_model(config, CPU, layer_config)
        for name, layer in model.named_modules():
            if isinstance(layer, LinearBase):
                with torch.inference_mode():
                    got = layer.method.apply(layer, torch.eye(layer.input_size), None).t()
                assert_within_one_rounding(got, shard(expected, name, layer, rank))


def test_block_fp8_scores_close_to_its_float_twin(checkpoint, tmp_path: Path) -> None:
    """Within the W8A8 bound of the channel-scaled checkpoints (6% of the logprobs' size)."""
    float_model, path, expected = checkpoint
    qc.write_float(float_model, tmp_path / "twin", expected)
    tokens = [random.Random(2).randrange(1, 400) for _ in range(60)]
    quantized = token_logprobs(load_model(EngineConfig(model=str(path)), CPU), tokens)
    twin = token_logprobs(load_model(EngineConfig(model=str(tmp_path / "twin")), CPU), tokens)
    assert float((quantized - twin).abs().mean()) < 0.06 * float(twin.abs().mean())


def test_blocks_that_a_shard_would_split_fail_at_load(checkpoint, tmp_path: Path) -> None:
    """64-row blocks over tensor parallelism of 2: k and v (64 rows each) give each rank 32
    rows, half a block."""
    _, path, _ = checkpoint
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    config = json.loads((broken / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (broken / "config.json").write_text(json.dumps(config))
    engine_config = EngineConfig(model=str(broken))
    layer_config = build_layer_config(engine_config, load_model_config(str(broken)), CPU)
    layer_config = dataclasses.replace(layer_config, tp=TensorParallel(0, 2))
    with pytest.raises(QuantizationError, match="not whole blocks"):
        load_model(engine_config, CPU, layer_config)
