"""GPT-OSS: transformers is the oracle. A tiny random GptOssForCausalLM whose features all
matter at its size (attention sinks well away from zero, biases on the router and the experts,
a clamp the experts' dots cross, YaRN past its original context, a window of 8 on every other
layer), driven through ModelRunner (tests/test_model_parity.py's mini scheduler, chunked
prefill included), over two tensor-parallel ranks and through `LLM`; OpenAI's MXFP4 experts
load as the float weights they encode."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.kernels.quant_ref import dequantize_mxfp4, quantize_mxfp4
from pagedserve.models.loader import load_model
from pagedserve.models.model_config import load_model_config, sliding_windows
from pagedserve.models.quantization.config import QuantizationError
from tests.engine_settings import NO_STANDBY
from tests.test_model_parity import (
    COMMON,
    LOGPROB_ATOL,
    assert_greedy_matches,
    assert_two_ranks_match_one,
    make_runner,
    random_prompts,
)
from tests.tiny_models import hf_greedy, merge_lora, save_lora_adapter, save_tiny_model

ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 32,  # the prompts run past it
}
CPU = torch.device("cpu")


def gpt_oss_config(**overrides: object) -> transformers.GptOssConfig:
    settings = dict(
        COMMON, intermediate_size=96, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, swiglu_limit=1.0, rope_parameters=ROPE,
    )  # fmt: skip
    return transformers.GptOssConfig(**(settings | overrides))


def save_gpt_oss(path: Path, seed: int = 0, **overrides: object) -> transformers.PreTrainedModel:
    """The tiny model, saved; its sinks and biases drawn large enough to change the logits."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        gpt_oss_config(**overrides), dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
            layer.mlp.router.bias.normal_(0.0, 1.0)
            layer.mlp.experts.gate_up_proj_bias.normal_(0.0, 0.5)
            layer.mlp.experts.down_proj_bias.normal_(0.0, 0.5)
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None  # greedy runs to max tokens
    return model.eval()


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, transformers.PreTrainedModel]:
    path = tmp_path_factory.mktemp("gpt_oss")
    return path, save_gpt_oss(path)


@pytest.mark.parametrize("backend", ["torch", "torch_ref"])
def test_greedy_parity_with_transformers(
    gpt_oss: tuple[Path, transformers.PreTrainedModel], backend: str
) -> None:
    path, hf_model = gpt_oss
    runner = make_runner(path, attention_backend=backend)
    assert_greedy_matches(runner, random_prompts(seed=3), functools.partial(hf_greedy, hf_model))


def leave_out(model: transformers.PreTrainedModel, feature: str) -> None:
    """Turn one of the model's GPT-OSS features off, in place."""
    if feature == "window":
        model.config.layer_types = ["full_attention"] * len(model.model.layers)
    for layer in model.model.layers:
        if feature == "sinks":
            layer.self_attn.sinks.fill_(-1e4)
        elif feature == "clamp":
            layer.mlp.experts.limit = 1e4
        elif feature == "expert biases":
            layer.mlp.experts.down_proj_bias.zero_()


@pytest.mark.parametrize("feature", ["sinks", "clamp", "expert biases", "window"])
def test_each_feature_changes_the_model(
    gpt_oss: tuple[Path, transformers.PreTrainedModel], feature: str
) -> None:
    """Controls for the parity test: with each feature left out, transformers' own logprobs
    of the test's prompts move by far more than the parity tolerance."""
    path, _ = gpt_oss
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    prompt = torch.tensor([random_prompts(seed=3)[4]])
    with torch.no_grad():
        before = torch.log_softmax(model(prompt).logits.float(), -1)
        leave_out(model, feature)
        after = torch.log_softmax(model(prompt).logits.float(), -1)
    assert float((before - after).abs().max()) > 100 * LOGPROB_ATOL, feature


def test_tensor_parallel_two_ranks_match_one(
    gpt_oss: tuple[Path, transformers.PreTrainedModel], tmp_path: Path
) -> None:
    """Two gloo ranks (two heads and their sinks each, half of every expert) give the
    single-process tokens and logprobs."""
    path, _ = gpt_oss
    assert_two_ranks_match_one(path, tmp_path)


def test_llm_generates_what_transformers_does(
    gpt_oss: tuple[Path, transformers.PreTrainedModel],
) -> None:
    """Through the public API, with a cache too small for every request at once (preemption)
    and a prompt whose prefix is cached; every block is free afterwards."""
    path, hf_model = gpt_oss
    prompts = random_prompts(seed=5)
    shared = prompts[4][:32] + [3, 4, 5]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with LLM(str(path), skip_tokenizer_init=True, num_kv_blocks=12, supervision=NO_STANDBY) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        preemptions = llm.get_stats().num_preemptions
        outputs += llm.generate([{"prompt_token_ids": shared}], params)
        stats = llm.get_stats()
    for prompt, output in zip([*prompts, shared], outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 20)[0]
    assert preemptions > 0 and outputs[-1].num_cached_tokens == 32
    assert stats.num_free_blocks == stats.num_total_blocks


def test_two_pipeline_stages_keep_transformers_tokens(
    gpt_oss: tuple[Path, transformers.PreTrainedModel],
) -> None:
    """Two pipeline stages of a layer each (the first's window and sinks, the second's full
    attention): transformers' greedy tokens."""
    path, hf_model = gpt_oss
    prompts = random_prompts(seed=6)[1:4]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(str(path), skip_tokenizer_init=True, pipeline_parallel_size=2,
             supervision=NO_STANDBY) as llm:  # fmt: skip
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 16)[0]


def test_lora_adapts_its_attention(
    gpt_oss: tuple[Path, transformers.PreTrainedModel], tmp_path: Path
) -> None:
    """An adapter on q_proj and o_proj (biased projections) gives transformers' tokens with the
    adapter merged."""
    path, hf_model = gpt_oss
    adapter = save_lora_adapter(path, tmp_path / "attn", seed=1, targets=["q_proj", "o_proj"])
    prompt = random_prompts(seed=2)[2]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(str(path), skip_tokenizer_init=True, enable_lora=True, max_lora_rank=8,
             supervision=NO_STANDBY) as llm:  # fmt: skip
        request = LoRARequest("a", 1, str(adapter))
        adapted = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=request)[0]
    merged = merge_lora(path, adapter)
    merged.generation_config.eos_token_id = None
    assert adapted.outputs[0].token_ids == hf_greedy(merged, prompt, 16)[0]
    assert adapted.outputs[0].token_ids != hf_greedy(hf_model, prompt, 16)[0]  # it adapts


def random_mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [*shape, 16] of random E2M1 code pairs and scales [*shape] of 2^-6 .. 2^0."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.int32)
    scales = torch.randint(121, 128, shape, generator=gen, dtype=torch.int32)
    return blocks.to(torch.uint8), scales.to(torch.uint8)


def test_an_mxfp4_checkpoint_generates_what_its_float_weights_do(tmp_path: Path) -> None:
    """OpenAI's layout (experts' weights as `*_blocks` / `*_scales`, quant_method mxfp4)
    runs as the float weights it encodes: the engine on it, its experts dequantized at load
    (the default) or kept 4-bit (quantization="mxfp4"), gives transformers' tokens on the
    dequantized float checkpoint; over two tensor-parallel ranks, its own tokens."""
    float_dir, mxfp4_dir = tmp_path / "float", tmp_path / "mxfp4"
    save_gpt_oss(float_dir, seed=2)
    tensors = load_file(float_dir / "model.safetensors")
    experts, two_i, hidden = 4, 192, COMMON["hidden_size"]
    for layer in range(COMMON["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts"
        for name, (rows, cols) in {"gate_up_proj": (two_i, hidden),
                                   "down_proj": (hidden, two_i // 2)}.items():  # fmt: skip
            blocks, scales = random_mxfp4((experts, rows, cols // 32), seed=10 * layer + rows)
            tensors[f"{prefix}.{name}"] = convert_moe_packed_tensors(
                blocks, scales, dtype=torch.float32
            )
            mxfp4 = {f"{prefix}.{name}_blocks": blocks, f"{prefix}.{name}_scales": scales}
            tensors.update(mxfp4)
    float_tensors = {k: v for k, v in tensors.items() if not k.endswith(("_blocks", "_scales"))}
    save_file(float_tensors, float_dir / "model.safetensors", metadata={"format": "pt"})
    mxfp4_dir.mkdir()
    mxfp4_tensors = {
        k: v for k, v in tensors.items() if not k.endswith(("gate_up_proj", "down_proj"))
    }
    save_file(mxfp4_tensors, mxfp4_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (mxfp4_dir / "config.json").write_text(json.dumps(config))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        float_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    hf_model.generation_config.eos_token_id = None
    greedy = functools.partial(hf_greedy, hf_model)
    kept = make_runner(mxfp4_dir, quantization="mxfp4")
    assert_greedy_matches(kept, random_prompts(seed=4), greedy)
    experts_module = kept.model.model.layers[0].mlp.experts  # kept 4-bit: 2 codes a byte
    assert experts_module.w13_codes.shape == (4, 192, 32) and not hasattr(experts_module, "w13")
    runner = make_runner(mxfp4_dir)  # by default dequantized at load
    assert_greedy_matches(runner, random_prompts(seed=4), greedy)
    experts_module = runner.model.model.layers[0].mlp.experts
    assert experts_module.w13.shape == (4, 192, 64) and not hasattr(experts_module, "w13_codes")
    assert_two_ranks_match_one(mxfp4_dir, tmp_path)


def test_mxfp4_quantization_rounds_to_the_nearest_code() -> None:
    """quant_ref.quantize_mxfp4: values already on the grid come back exactly, others to a
    nearest code of their block's scale (within half a step of the binade), past 6 scales
    saturated; the scale is 2^(floor(log2 amax) - 2)."""
    gen = torch.Generator().manual_seed(0)
    on_grid = dequantize_mxfp4(*random_codes((3, 64), gen), torch.float32)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(on_grid), torch.float32), on_grid)
    w = torch.randn(3, 64, generator=gen) * 0.05
    codes, scales = quantize_mxfp4(w)
    back = dequantize_mxfp4(codes, scales, torch.float32).unflatten(-1, (-1, 32))
    blocks = w.unflatten(-1, (-1, 32))
    scale = torch.exp2(scales.float() - 127).unsqueeze(-1)
    amax = blocks.abs().amax(-1, keepdim=True)
    assert torch.equal(scale, torch.exp2(torch.floor(torch.log2(amax)) - 2))
    error = (back - blocks).abs() / scale  # in units of the scale: steps of 0.5, 1 and 2
    step = torch.where(blocks.abs() / scale < 2, 0.5, torch.where(blocks.abs() / scale < 4, 1, 2))
    saturated = blocks.abs() / scale > 6
    assert bool((error[~saturated] <= step[~saturated] / 2 + 1e-6).all())
    assert bool((back.abs()[saturated] == 6 * scale.expand_as(back)[saturated]).all())


def random_codes(shape: tuple[int, int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 128, (*shape[:-1], shape[-1] // 32), generator=gen)
    return codes, scales.to(torch.uint8)


def test_dummy_weights_of_an_mxfp4_config_run_mxfp4_experts(tmp_path: Path) -> None:
    """Benchmarks' dummy weights of a GPT-OSS release's config with quantization="mxfp4":
    the float weights are quantized to MXFP4 after loading, and the engine generates with
    them (without it they stay float)."""
    save_gpt_oss(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 64  # whole groups of 32 inputs for w2
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    mxfp4 = {"load_format": "dummy", "quantization": "mxfp4"}
    model = load_model(EngineConfig(model=str(tmp_path), **mxfp4), CPU)
    experts = model.model.layers[1].mlp.experts
    assert experts.w13_codes.shape == (4, 128, 32) and experts.w2_scales.shape == (4, 64, 2)
    dummy = load_model(EngineConfig(model=str(tmp_path), load_format="dummy"), CPU)
    assert dummy.model.layers[1].mlp.experts.w13.dtype == torch.float32
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(tmp_path), **mxfp4, skip_tokenizer_init=True,
             supervision=NO_STANDBY) as llm:  # fmt: skip
        output = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params)[0]
    assert len(output.outputs[0].token_ids) == 8


def test_model_config_fills_gpt_oss_defaults(tmp_path: Path) -> None:
    """A config.json that leaves the fields out reads as transformers' GptOssConfig does."""
    (tmp_path / "config.json").write_text('{"model_type": "gpt_oss", "num_hidden_layers": 4}')
    ours = load_model_config(str(tmp_path))
    theirs = transformers.GptOssConfig(num_hidden_layers=4)
    for name in ("num_local_experts", "num_experts_per_tok", "head_dim", "sliding_window",
                 "swiglu_alpha", "swiglu_limit", "attention_bias", "rms_norm_eps",
                 "num_key_value_heads", "max_position_embeddings"):  # fmt: skip
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.rope_parameters == theirs.rope_parameters
    windows = [128 if kind == "sliding_attention" else 0 for kind in theirs.layer_types]
    assert sliding_windows(ours.to_dict()) == windows


def test_mxfp4_refuses_what_it_cannot_be(
    gpt_oss: tuple[Path, transformers.PreTrainedModel], tmp_path: Path
) -> None:
    """quantization="mxfp4" needs OpenAI's MXFP4 checkpoint, and that format a GPT-OSS model."""
    path, _ = gpt_oss
    with pytest.raises(QuantizationError, match="needs a checkpoint with MXFP4 experts"):
        load_model(EngineConfig(model=str(path), quantization="mxfp4"), CPU)
    llama = save_tiny_model("llama", tmp_path / "llama")
    config = json.loads((llama / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (llama / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError, match="GPT-OSS only"):
        load_model(EngineConfig(model=str(llama)), CPU)
