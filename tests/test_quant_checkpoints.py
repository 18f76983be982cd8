"""Quantized checkpoints in their published Hugging Face layouts (written by
tests/quant_checkpoints.py from a tiny random Llama) load into the engine's layers with the
weights they stand for, score a sequence exactly as the float model of those weights does, and
generate through the whole engine; unsupported settings fail at load with a clear message."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.models.layer_config import TensorParallel
from pagedserve.models.layers import Attention
from pagedserve.models.linear import LinearBase, RowParallelLinear
from pagedserve.models.loader import build_layer_config, load_model
from pagedserve.models.model_config import load_model_config
from pagedserve.models.quantization.config import QuantizationError
from pagedserve.models.scoring import score, token_logprobs
from tests import quant_checkpoints as qc
from tests.engine_settings import NO_STANDBY
from tests.tiny_models import save_tiny_model

CPU = torch.device("cpu")
# the checkpoint names of each fused layer's parts, in the fused weight's order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
WRITERS: dict[str, qc.Writer] = {
    "gptq-int4-sym": lambda s, t: qc.write_gptq(s, t, 4, 64, symmetric=True, act_order=False),
    "gptq-int4-asym-act-order": lambda s, t: qc.write_gptq(s, t, 4, 64, False, act_order=True),
    "gptq-int8-sym": lambda s, t: qc.write_gptq(s, t, 8, 128, True, act_order=False),
    "awq-int4": lambda s, t: qc.write_awq(s, t, 64),
    "ct-int4-sym-group": lambda s, t: qc.write_compressed_int(s, t, 4, 64, True),
    "ct-int4-asym-act-order": lambda s, t: qc.write_compressed_int(s, t, 4, 64, False, True),
    "ct-int8-asym-channel": lambda s, t: qc.write_compressed_int(s, t, 8, None, False),
    "ct-fp8-channel": qc.write_compressed_fp8,
    "vllm-fp8-tensor-static": lambda s, t: qc.write_vllm_fp8(s, t),
}
INTEGER = [name for name in WRITERS if "fp8" not in name]


@pytest.fixture(scope="module")
def float_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama: hidden 128, intermediate 256, 4 heads of 32, 2 kv heads."""
    return save_tiny_model("llama", tmp_path_factory.mktemp("float"), seed=3, hidden_size=128)


@pytest.fixture(scope="module")
def checkpoints(
    float_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[Path, dict[str, torch.Tensor]]]:
    """checkpoint(format) -> (its directory, the dequantized weight of each tensor name)."""
    return qc.memoized_writer(float_model, WRITERS, tmp_path_factory)


def effective_weight(layer: LinearBase) -> torch.Tensor:
    """The layer's W [out, in] as it computes: its output for the identity (no bias here)."""
    with torch.inference_mode():
        return layer(torch.eye(layer.input_size)).t()


def part_names(name: str) -> list[str]:
    """The checkpoint weights of the fused module `name` (model.layers.0.self_attn.qkv_proj)."""
    prefix, module = name.rsplit(".", 1)
    return [f"{prefix}.{part}.weight" for part in FUSED.get(module, (module,))]


def expected_weight(name: str, expected: dict[str, torch.Tensor]) -> torch.Tensor:
    """The fused parameter `name` from the checkpoint's dequantized parts."""
    return torch.cat([expected[part] for part in part_names(name)])


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_checkpoint_loads_the_weights_it_stands_for(fmt: str, checkpoints) -> None:
    path, expected = checkpoints(fmt)
    model = load_model(EngineConfig(model=str(path)), CPU)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}
    assert len(layers) == 8  # qkv, o, gate_up, down in each of 2 layers
    for name, layer in layers.items():
        assert not hasattr(layer, "weight") or layer.weight.dtype != torch.float32, name
        torch.testing.assert_close(
            effective_weight(layer), expected_weight(name, expected), atol=1e-6, rtol=1e-6
        )


def shard(
    expected: dict[str, torch.Tensor], name: str, layer: LinearBase, rank: int
) -> torch.Tensor:
    """Rank `rank` of 2's part of the fused weight `name`: its rows of every fused part
    (column-parallel) or its input columns (row-parallel)."""
    if isinstance(layer, RowParallelLinear):
        return expected_weight(name, expected).narrow(1, rank * layer.input_size, layer.input_size)
    parts = [expected[part] for part in part_names(name)]
    return torch.cat([p.narrow(0, rank * p.shape[0] // 2, p.shape[0] // 2) for p in parts])


@pytest.mark.parametrize(
    "fmt", ["gptq-int4-sym", "awq-int4", "ct-int8-asym-channel", "vllm-fp8-tensor-static",
            "ct-int4-sym-group"],
)  # fmt: skip
def test_tensor_parallel_ranks_load_their_shards(fmt: str, checkpoints) -> None:
    """Two ranks (sharded without a process group: the layers' products are checked alone):
    each holds its rows (column-parallel) or input columns (row-parallel) of every packed
    tensor, group scales and per-part scales."""
    path, expected = checkpoints(fmt)
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
                want = shard(expected, name, layer, rank)
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("fmt", INTEGER)
def test_integer_checkpoint_scores_as_its_float_twin(
    fmt: str, checkpoints, float_model: Path, tmp_path: Path
) -> None:
    """Weight-only schemes compute with exactly the dequantized weights: a sequence's
    logprobs match the float model of those weights (float32 summation order aside)."""
    path, expected = checkpoints(fmt)
    qc.write_float(float_model, tmp_path / "twin", expected)
    tokens = [random.Random(1).randrange(1, 400) for _ in range(60)]
    quantized = token_logprobs(load_model(EngineConfig(model=str(path)), CPU), tokens)
    twin = token_logprobs(load_model(EngineConfig(model=str(tmp_path / "twin")), CPU), tokens)
    torch.testing.assert_close(quantized, twin, atol=1e-4, rtol=0)


def test_fp8_checkpoint_scores_close_to_its_float_twin(
    checkpoints, float_model: Path, tmp_path: Path
) -> None:
    """W8A8 also rounds the activations to fp8 (per token): close to the float model of the
    weights, within 6% of the logprobs' size."""
    path, expected = checkpoints("ct-fp8-channel")
    qc.write_float(float_model, tmp_path / "twin", expected)
    tokens = [random.Random(2).randrange(1, 400) for _ in range(60)]
    quantized = token_logprobs(load_model(EngineConfig(model=str(path)), CPU), tokens)
    twin = token_logprobs(load_model(EngineConfig(model=str(tmp_path / "twin")), CPU), tokens)
    # this random model's logits are peaked (large activations): about 3% here
    assert float((quantized - twin).abs().mean()) < 0.06 * float(twin.abs().mean())


def test_gptq_act_order_checkpoint_generates_through_the_engine(
    checkpoints, float_model: Path, tmp_path: Path
) -> None:
    """The whole engine (actor processes, the CPU attention backend, prefill and decode
    steps) on the GPTQ act-order checkpoint generates its float twin's greedy tokens: at
    every position, the token the twin ranks first (teacher-forced on the engine's output)."""
    path, expected = checkpoints("gptq-int4-asym-act-order")
    qc.write_float(float_model, tmp_path / "twin", expected)
    prompts = [[random.Random(i).randrange(1, 400) for _ in range(9 + 7 * i)] for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(
        str(path), num_kv_blocks=64, max_num_seqs=4, supervision=NO_STANDBY,
        skip_tokenizer_init=True,  # token ids in and out: no tokenizer to load
    ) as llm:  # fmt: skip
        outputs = llm.generate(prompts, greedy)
    twin = load_model(EngineConfig(model=str(tmp_path / "twin")), CPU)
    for prompt, output in zip(prompts, outputs):
        tokens = output.outputs[0].token_ids
        assert len(tokens) == 16
        assert score(twin, prompt + tokens).argmax[-16:].tolist() == tokens


def test_fp8_kv_scales_load_from_the_checkpoint(float_model: Path, tmp_path: Path) -> None:
    qc.write_vllm_fp8(float_model, tmp_path / "fp8", kv_scales=(0.25, 0.5))
    model = load_model(EngineConfig(model=str(tmp_path / "fp8"), kv_cache_dtype="fp8"), CPU)
    attention = [m for m in model.modules() if isinstance(m, Attention)]
    assert [m.kv_scales for m in attention] == [(0.25, 0.5)] * 2
    plain = load_model(EngineConfig(model=str(tmp_path / "fp8")), CPU)  # no fp8 KV: unused
    assert all(m.kv_scales == (1.0, 1.0) for m in plain.modules() if isinstance(m, Attention))


def test_fused_parts_must_share_their_act_order(checkpoints, tmp_path: Path) -> None:
    """q, k and v read one input: a checkpoint whose k_proj orders its groups differently
    from q_proj cannot be fused."""
    import shutil

    from safetensors.torch import load_file, save_file

    path, _ = checkpoints("gptq-int4-asym-act-order")
    shutil.copytree(path, tmp_path / "broken")
    state = load_file(path / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.g_idx"
    state[name] = state[name].flip(0).contiguous()
    save_file(state, tmp_path / "broken" / "model.safetensors")
    with pytest.raises(ValueError, match="disagree"):
        load_model(EngineConfig(model=str(tmp_path / "broken")), CPU)


def _with_config(path: Path, target: Path, change: Callable[[dict], None]) -> Path:
    import shutil

    shutil.copytree(path, target)
    config = json.loads((target / "config.json").read_text())
    change(config["quantization_config"])
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    "fmt,change,message",
    [
        ("gptq-int4-sym", lambda c: c.update(bits=3), "3-bit"),
        ("gptq-int4-sym", lambda c: c.update(lm_head=True), "LM head"),
        ("awq-int4", lambda c: c.update(version="gemv"), "gemv"),
        ("ct-int4-sym-group", lambda c: c.update(ignore=["model.layers.0.mlp.down_proj"]),
         "per-module"),
        ("vllm-fp8-tensor-static", lambda c: c.update(weight_block_size=[128, 128]), "block"),
        ("gptq-int4-sym", lambda c: c.update(quant_method="bitsandbytes"), "bitsandbytes"),
    ],
)  # fmt: skip
def test_unsupported_checkpoints_fail_at_load(
    fmt: str, change: Callable[[dict], None], message: str, checkpoints, tmp_path: Path
) -> None:
    path, _ = checkpoints(fmt)
    broken = _with_config(path, tmp_path / "broken", change)
    with pytest.raises(QuantizationError, match=message):
        load_model(EngineConfig(model=str(broken)), CPU)


def test_requested_method_must_match_the_checkpoint(checkpoints, float_model: Path) -> None:
    path, _ = checkpoints("awq-int4")
    with pytest.raises(QuantizationError, match="awq-quantized"):
        load_model(EngineConfig(model=str(path), quantization="gptq"), CPU)
    with pytest.raises(QuantizationError, match="needs a checkpoint"):
        load_model(EngineConfig(model=str(float_model), quantization="gptq"), CPU)
