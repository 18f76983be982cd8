"""Int4 (W4A16) experts of a mixture-of-experts model from GPTQ, AWQ and compressed-tensors
checkpoints written in their published layouts (tests/quant_checkpoints.py, from a tiny random
Qwen3-MoE whose router stays float, as the published checkpoints leave it): each expert's
packed codes, scales and zero points load into the stacked experts with the weights they stand
for; the model scores and generates as the float model of those (dequantized) weights; tensor
parallelism keeps whole groups (each rank's share checked without a process group); what the
engine cannot run fails at load with a clear message.

The kernels' side (the Triton grouped GEMM dequantizing int4 in its K loop) is in
test_moe_kernels.py."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.kernels import moe_ref
from pagedserve.kernels.moe_ref import Int4Experts
from pagedserve.kernels.quant_ref import dequantize_int_weight
from pagedserve.models.layer_config import TensorParallel
from pagedserve.models.loader import build_layer_config, load_model
from pagedserve.models.model_config import load_model_config
from pagedserve.models.moe import FusedMoE
from pagedserve.models.quantization.config import QuantizationError
from pagedserve.models.scoring import score, token_logprobs
from tests import quant_checkpoints as qc
from tests.engine_settings import NO_STANDBY
from tests.test_model_parity import (
    COMMON,
    random_prompts,
)
from tests.test_moe import stacked

CPU = torch.device("cpu")
NUM_EXPERTS = 4
INTER = 64  # the experts' intermediate size: two groups of 32, one of 64


def _gptq(source: Path, target: Path) -> dict[str, torch.Tensor]:
    return qc.write_gptq(source, target, 4, 32, symmetric=True, act_order=False)


def _awq(source: Path, target: Path) -> dict[str, torch.Tensor]:
    """AWQ as Mixtral's and Qwen-MoE's AWQ releases config it: the routers not converted."""
    expected = qc.write_awq(source, target, 32)
    _change_config(target, lambda c: c.update(modules_to_not_convert=["gate"]))
    return expected


def _compressed(source: Path, target: Path) -> dict[str, torch.Tensor]:
    """llm-compressor's W4A16 recipe for MoE models: asymmetric, the routers ignored."""
    expected = qc.write_compressed_int(source, target, 4, 64, symmetric=False)
    _change_config(target, lambda c: c.update(ignore=["lm_head", "re:.*mlp.gate$"]))
    return expected


WRITERS: dict[str, Callable[[Path, Path], dict[str, torch.Tensor]]] = {
    "gptq-sym-g32": _gptq,
    "awq-g32": _awq,
    "ct-asym-g64": _compressed,
}


def _change_config(path: Path, change: Callable[[dict], None]) -> None:
    config = json.loads((path / "config.json").read_text())
    change(config["quantization_config"])
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def float_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-MoE: 2 sparse layers of 4 experts (top 2, renormalised), hidden 64, experts'
    intermediate 64."""
    path = tmp_path_factory.mktemp("float_moe")
    config = transformers.Qwen3MoeConfig(
        **COMMON, head_dim=32, num_experts=NUM_EXPERTS, num_experts_per_tok=2,
        moe_intermediate_size=INTER, norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(
    float_moe: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[Path, dict[str, torch.Tensor]]]:
    """checkpoint(format) -> (its directory, the dequantized weight of each tensor name)."""
    return qc.memoized_writer(float_moe, WRITERS, tmp_path_factory)


def int4_experts(experts: FusedMoE) -> tuple[Int4Experts, Int4Experts]:
    """The layer's w13 and w2 as the expert kernels take them."""
    w13, w2 = (
        Int4Experts(getattr(experts, name), getattr(experts, f"{name}_scales"),
                    getattr(experts, f"{name}_zeros"), experts.group_sizes[name])
        for name in ("w13", "w2")
    )  # fmt: skip
    assert w13.qweight.dtype == w2.qweight.dtype == torch.int32
    return w13, w2


def dequantized_experts(experts: FusedMoE) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's int4 w13 and w2 as it computes with them, in float32."""
    w13, w2 = (
        torch.stack([dequantize_int_weight(w.expert(e), torch.float32)
                     for e in range(NUM_EXPERTS)])
        for w in int4_experts(experts)
    )  # fmt: skip
    return w13, w2


def moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.mlp for layer in model.model.layers]


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_int4_checkpoint_loads_its_experts_and_scores_as_its_float_twin(
    fmt: str, checkpoints, float_moe: Path, tmp_path: Path
) -> None:
    """Every layer's experts hold exactly the checkpoint's dequantized weights (the router
    stays float); a sequence's logprobs match the float model of those weights within 1e-4
    (float32, the summation order aside)."""
    path, expected = checkpoints(fmt)
    model = load_model(EngineConfig(model=str(path)), CPU)
    for index, block in enumerate(moe_layers(model)):
        assert block.gate.weight.dtype == torch.float32
        for got, want in zip(
            dequantized_experts(block.experts), stacked(expected, index, NUM_EXPERTS)
        ):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    qc.write_float(float_moe, tmp_path / "twin", expected)
    tokens = random_prompts(seed=4)[7]
    twin = token_logprobs(load_model(EngineConfig(model=str(tmp_path / "twin")), CPU), tokens)
    torch.testing.assert_close(token_logprobs(model, tokens), twin, atol=1e-4, rtol=0)


def rank_slice(w13: torch.Tensor, w2: torch.Tensor, rank: int) -> tuple[torch.Tensor, ...]:
    """Rank `rank` of 2's part of stacked w13 [E, 2I, H] (its rows of gate, then of up) and
    w2 [E, H, I] (its input columns)."""
    half = INTER // 2
    gate, up = w13[:, :INTER], w13[:, INTER:]
    rows = slice(rank * half, (rank + 1) * half)
    return torch.cat([gate[:, rows], up[:, rows]], dim=1), w2[:, :, rows]


@pytest.mark.parametrize("fmt", ["gptq-sym-g32", "awq-g32"])
def test_tensor_parallel_ranks_hold_whole_groups_of_their_experts(fmt: str, checkpoints) -> None:
    """Two ranks (no process group: what each computes before the all-reduce), each with half
    of every expert's intermediate dim (its rows of gate and up, one group of 32 of w2's
    inputs): each holds its slice of the dequantized weights, and the two ranks' partial
    outputs sum to the one-rank layer's."""
    path, expected = checkpoints(fmt)
    config, hf_config = EngineConfig(model=str(path)), load_model_config(str(path))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=gen)
    weights = torch.rand(6, 2, generator=gen)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:2] for _ in range(6)])
    with torch.inference_mode():
        whole = moe_layers(load_model(config, CPU))[0].experts(x, weights, ids)
    partial_sum = torch.zeros_like(whole)
    for rank in (0, 1):
        layer_config = build_layer_config(config, hf_config, CPU)
        layer_config = dataclasses.replace(layer_config, tp=TensorParallel(rank, 2))
        blocks = moe_layers(load_model(config, CPU, layer_config))
        for index, block in enumerate(blocks):
            want = rank_slice(*stacked(expected, index, NUM_EXPERTS), rank)
            for got, w in zip(dequantized_experts(block.experts), want):
                torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-7)
        w13, w2 = int4_experts(blocks[0].experts)
        partial_sum += moe_ref.fused_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(partial_sum, whole, rtol=1e-5, atol=1e-5)


def test_awq_checkpoint_generates_its_float_twins_greedy_tokens(
    checkpoints, float_moe: Path, tmp_path: Path
) -> None:
    """The whole engine (prefill and decode steps) on the AWQ checkpoint: at every position the
    token its float twin ranks first (teacher-forced on the engine's output)."""
    path, expected = checkpoints("awq-g32")
    qc.write_float(float_moe, tmp_path / "twin", expected)
    prompts = random_prompts(seed=5)[:3]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(
        str(path), skip_tokenizer_init=True, num_kv_blocks=64, max_num_seqs=4,
        supervision=NO_STANDBY,
    ) as llm:  # fmt: skip
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    twin = load_model(EngineConfig(model=str(tmp_path / "twin")), CPU)
    for prompt, output in zip(prompts, outputs):
        tokens = output.outputs[0].token_ids
        assert len(tokens) == 12
        assert score(twin, prompt + tokens).argmax[-12:].tolist() == tokens


def test_dummy_weights_of_an_int4_scheme_quantize_the_experts(float_moe: Path) -> None:
    """load_format "dummy" with quantization "gptq" (benchmarks): random float experts
    quantized to int4 at load, groups of 128 falling back to one a row (64 inputs)."""
    config = EngineConfig(model=str(float_moe), load_format="dummy", quantization="gptq")
    experts = load_model(config, CPU).model.layers[0].mlp.experts
    assert experts.w13.shape == (NUM_EXPERTS, 2 * INTER, 64 // 8)
    assert experts.w2_scales.shape == (NUM_EXPERTS, 64, 1)


def test_groups_split_by_tensor_parallelism_fail_at_load(checkpoints) -> None:
    """Groups of 64 of the experts' 64 intermediate channels cannot be split over 2 ranks."""
    path, _ = checkpoints("ct-asym-g64")
    config = EngineConfig(model=str(path))
    layer_config = build_layer_config(config, load_model_config(str(path)), CPU)
    layer_config = dataclasses.replace(layer_config, tp=TensorParallel(0, 2))
    with pytest.raises(QuantizationError, match=r"intermediate size per rank \(64 / 2 = 32\)"):
        load_model(config, CPU, layer_config)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda c: c.update(desc_act=True), "act-order int4 experts"),
        (lambda c: c.update(bits=8), "not supported for the experts"),
    ],
)  # fmt: skip
def test_unsupported_int_experts_fail_at_load(
    change: Callable[[dict], None], message: str, checkpoints, tmp_path: Path
) -> None:
    path, _ = checkpoints("gptq-sym-g32")
    shutil.copytree(path, tmp_path / "broken")
    _change_config(tmp_path / "broken", change)
    with pytest.raises(QuantizationError, match=message):
        load_model(EngineConfig(model=str(tmp_path / "broken")), CPU)


def test_only_the_routers_may_stay_unquantized(checkpoints, tmp_path: Path) -> None:
    path, _ = checkpoints("awq-g32")
    shutil.copytree(path, tmp_path / "broken")
    _change_config(
        tmp_path / "broken", lambda c: c.update(modules_to_not_convert=["gate", "o_proj"])
    )
    with pytest.raises(QuantizationError, match="per-module exceptions"):
        load_model(EngineConfig(model=str(tmp_path / "broken")), CPU)
