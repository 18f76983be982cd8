"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE): transformers is the oracle.
Tiny random models in the checkpoints' published layout (one tensor per expert and
projection), driven through ModelRunner (tests/test_model_parity.py's mini scheduler, with a
chunked prefill) and through `LLM`; the expert weights' loading, tensor-parallel sharding and
the start-up checks."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.kernels import moe_ref
from pagedserve.models.loader import load_model
from pagedserve.models.model_config import load_model_config, num_experts
from pagedserve.models.moe import MIXTRAL_EXPERTS, QWEN_EXPERTS, expert_target
from pagedserve.models.scoring import token_logprobs
from tests import quant_checkpoints as qc
from tests.engine_settings import NO_STANDBY
from tests.test_model_parity import (
    COMMON,
    assert_greedy_matches,
    assert_two_ranks_match_one,
    make_runner,
    random_prompts,
)
from tests.tiny_models import hf_greedy, merge_lora, save_lora_adapter

CPU = torch.device("cpu")
MOE_CONFIGS = {
    # top-2 of 8, renormalised; layer 1 dense (mlp_only_layers)
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),  # fmt: skip
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, num_local_experts=4, num_experts_per_tok=2
    ),
    # top-3 of 8, not renormalised, and the gated shared expert
    "qwen2-moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=96,
    ),  # fmt: skip
}


def save_moe_model(arch: str, path: Path) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = MOE_CONFIGS[arch]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None  # greedy runs to max tokens
    return model.eval()


@pytest.mark.parametrize("arch", sorted(MOE_CONFIGS))
def test_greedy_parity_with_transformers(arch: str, tmp_path: Path) -> None:
    hf_model = save_moe_model(arch, tmp_path)
    runner = make_runner(tmp_path)
    assert_greedy_matches(runner, random_prompts(seed=3), functools.partial(hf_greedy, hf_model))


def test_the_checkpoint_fills_every_expert(tmp_path: Path) -> None:
    """Each expert's gate, up and down land in its slice of the stacked weights; a checkpoint
    missing one expert's projection does not load."""
    hf_model = save_moe_model("qwen3-moe", tmp_path)
    model = load_model(EngineConfig(model=str(tmp_path)), torch.device("cpu"))
    ours = model.model.layers[0].mlp.experts
    theirs = hf_model.model.layers[0].mlp.experts  # transformers stacks them too: [E, 2I, H]
    assert torch.equal(ours.w13, theirs.gate_up_proj)
    assert torch.equal(ours.w2, theirs.down_proj)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.5.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KeyError, match=r"model\.layers\.0\.mlp\.experts\.w13"):
        load_model(EngineConfig(model=str(tmp_path)), torch.device("cpu"))


def test_expert_tensor_names() -> None:
    assert expert_target("model.layers.3.mlp.experts.17.up_proj.weight", QWEN_EXPERTS) == (
        "model.layers.3.mlp.experts.w13",
        (17, 1),
    )
    assert expert_target("model.layers.0.mlp.experts.2.w2.weight", MIXTRAL_EXPERTS) == (
        "model.layers.0.mlp.experts.w2",
        (2, None),
    )
    assert expert_target("model.layers.0.mlp.shared_expert.up_proj.weight", QWEN_EXPERTS) is None
    assert expert_target("model.layers.0.mlp.gate.weight", QWEN_EXPERTS) is None


@pytest.mark.parametrize("arch", sorted(MOE_CONFIGS))
def test_model_config_reads_the_expert_fields(arch: str, tmp_path: Path) -> None:
    hf = MOE_CONFIGS[arch]()
    hf.save_pretrained(tmp_path)
    ours = load_model_config(str(tmp_path))
    expected = getattr(hf, "num_local_experts", None) or hf.num_experts
    assert num_experts(ours) == expected
    assert ours.num_experts_per_tok == hf.num_experts_per_tok
    bare = type(hf)()  # the defaults of a file that leaves the fields out
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text(
        f'{{"model_type": "{hf.model_type}", "hidden_size": 64}}'
    )
    sparse = load_model_config(str(tmp_path / "bare"))
    assert num_experts(sparse) == (getattr(bare, "num_local_experts", None) or bare.num_experts)
    for name in ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                 "shared_expert_intermediate_size", "decoder_sparse_step", "num_key_value_heads",
                 "max_position_embeddings"):  # fmt: skip
        if hasattr(bare, name):
            assert getattr(sparse, name) == getattr(bare, name), (arch, name)


def test_reference_experts_match_a_dense_loop() -> None:
    """moe_ref.fused_experts against the formula, token by token."""
    gen = torch.Generator().manual_seed(0)
    t, hidden, inter, experts, k = 9, 16, 12, 5, 2
    x = torch.randn(t, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen)
    w2 = torch.randn(experts, hidden, inter, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen)
    got = moe_ref.fused_experts(x, w13, w2, weights, ids)
    for i in range(t):
        want = torch.zeros(hidden)
        for j in range(k):
            gate, up = (w13[ids[i, j]] @ x[i]).chunk(2)
            want += weights[i, j] * (w2[ids[i, j]] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


def test_llm_generates_what_transformers_does(tmp_path: Path) -> None:
    """Through the public API: more requests than the KV cache holds at once (preemption), then
    a prompt whose prefix is cached, give transformers' greedy tokens; every block is free
    afterwards."""
    hf_model = save_moe_model("qwen2-moe", tmp_path)
    prompts = random_prompts(seed=7)
    shared = prompts[4][:40] + [7, 8, 9]  # its first two blocks are prompts[4]'s
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(
        str(tmp_path), skip_tokenizer_init=True, num_kv_blocks=12, supervision=NO_STANDBY
    ) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        preemptions = llm.get_stats().num_preemptions
        llm.generate([{"prompt_token_ids": prompts[4]}], params)
        outputs += llm.generate([{"prompt_token_ids": shared}], params)
        stats = llm.get_stats()
    for prompt, output in zip([*prompts, shared], outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 24)[0]
    assert preemptions > 0 and outputs[-1].num_cached_tokens == 32
    assert stats.num_free_blocks == stats.num_total_blocks


def test_quantized_experts_fail_at_start(tmp_path: Path) -> None:
    save_moe_model("mixtral", tmp_path)
    config = EngineConfig(model=str(tmp_path), quantization="int8")
    with pytest.raises(ValueError, match="not supported for the experts of a mixture-of-experts"):
        load_model(config, torch.device("cpu"))


def test_tensor_parallel_two_ranks_match_one(tmp_path: Path) -> None:
    """Two gloo ranks, each with half of every expert's intermediate dim (and half of the
    shared expert's), give the single-process tokens and logprobs."""
    save_moe_model("qwen2-moe", tmp_path)
    assert_two_ranks_match_one(tmp_path, tmp_path)


def test_lora_adapts_the_attention_of_a_moe_model(tmp_path: Path) -> None:
    """An adapter on q_proj and v_proj runs (the output equals transformers with the adapter
    merged); one on the experts' projections is refused with a clear message."""
    base = tmp_path / "base"
    save_moe_model("qwen3-moe", base)
    attention = save_lora_adapter(base, tmp_path / "attn", seed=1, targets=["q_proj", "v_proj"])
    experts = tmp_path / "experts"
    shutil.copytree(attention, experts)
    config = json.loads((experts / "adapter_config.json").read_text())
    (experts / "adapter_config.json").write_text(
        json.dumps(config | {"target_modules": ["q_proj", "up_proj"]})
    )
    prompt = random_prompts(seed=2)[2]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(
        str(base), skip_tokenizer_init=True, enable_lora=True, max_lora_rank=8,
        num_kv_blocks=64, supervision=NO_STANDBY,
    ) as llm:  # fmt: skip
        adapted = llm.generate(
            [{"prompt_token_ids": prompt}], params, lora_request=LoRARequest("a", 1, str(attention))
        )[0]
        with pytest.raises(ValueError, match="mixture-of-experts model adapts only the attention"):
            llm.generate(
                [{"prompt_token_ids": prompt}], params,
                lora_request=LoRARequest("e", 2, str(experts)),
            )  # fmt: skip
    merged = merge_lora(base, attention)
    merged.generation_config.eos_token_id = None
    assert adapted.outputs[0].token_ids == hf_greedy(merged, prompt, 16)[0]


def dequantized_experts(model: torch.nn.Module, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s fp8 experts as the engine computes with them: w13 and w2 times their
    per-channel scales."""
    experts = model.model.layers[layer].mlp.experts
    assert experts.w13.dtype == torch.float8_e4m3fn
    return (
        experts.w13.float() * experts.w13_scale[..., None],
        experts.w2.float() * experts.w2_scale[..., None],
    )


def stacked(expected: dict[str, torch.Tensor], layer: int, experts: int) -> tuple:
    """A checkpoint's dequantized expert weights of `layer`, stacked as w13 and w2."""
    prefix = f"model.layers.{layer}.mlp.experts"
    w13 = torch.stack([
        torch.cat([expected[f"{prefix}.{e}.gate_proj.weight"],
                   expected[f"{prefix}.{e}.up_proj.weight"]])
        for e in range(experts)
    ])  # fmt: skip
    w2 = torch.stack([expected[f"{prefix}.{e}.down_proj.weight"] for e in range(experts)])
    return w13, w2


@pytest.fixture(scope="module")
def float_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("float_moe")
    save_moe_model("qwen3-moe", path)
    return path


def test_fp8_checkpoints_of_a_moe_model_load_their_experts(float_moe: Path, tmp_path: Path) -> None:
    """A per-tensor FP8 checkpoint's experts (one scale an expert's projection) exactly; a
    block-wise one's (16 x 16 blocks, re-quantized per channel at load) within one more fp8
    rounding; the engine's scores of a sequence stay close to the float model's."""
    per_tensor = qc.write_vllm_fp8(float_moe, tmp_path / "tensor", static=False)
    block = qc.write_block_fp8(float_moe, tmp_path / "block", block=(16, 16))
    tokens = random_prompts(seed=4)[7]
    float_scores = token_logprobs(load_model(EngineConfig(model=str(float_moe)), CPU), tokens)
    for path, expected, exact in ((tmp_path / "tensor", per_tensor, True),
                                  (tmp_path / "block", block, False)):  # fmt: skip
        model = load_model(EngineConfig(model=str(path)), CPU)
        got, want = dequantized_experts(model, 0), stacked(expected, 0, 8)
        for g, w in zip(got, want):
            if exact:
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
            else:
                row_scale = w.abs().amax(dim=2, keepdim=True) / 448
                assert bool(((g - w).abs() <= 2**-4 * w.abs() + row_scale * 2**-10).all())
        scores = token_logprobs(model, tokens)
        assert float((scores - float_scores).abs().mean()) < 0.06 * float(float_scores.abs().mean())


def test_fp8_quantized_at_load_runs_a_moe_model_close_to_float(float_moe: Path) -> None:
    """quantization="fp8" on the float checkpoint (experts and attention in fp8): the engine
    generates and frees every block; the fp8 model's teacher-forced scores of the float
    engine's greedy tokens stay within 6% of the float model's (this random model's
    next-token distributions are nearly flat, so greedy tokens themselves flip easily)."""
    prompts = random_prompts(seed=5)[:4]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    outputs = {}
    for quantization in (None, "fp8"):
        with LLM(
            str(float_moe), skip_tokenizer_init=True, quantization=quantization,
            num_kv_blocks=64, supervision=NO_STANDBY,
        ) as llm:  # fmt: skip
            outputs[quantization] = [o.outputs[0].token_ids for o in llm.generate(requests, params)]
            stats = llm.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        assert all(len(tokens) == 12 for tokens in outputs[quantization])
    float_model = load_model(EngineConfig(model=str(float_moe)), CPU)
    fp8_model = load_model(EngineConfig(model=str(float_moe), quantization="fp8"), CPU)
    for prompt, tokens in zip(prompts, outputs[None]):
        want = token_logprobs(float_model, prompt + tokens)
        got = token_logprobs(fp8_model, prompt + tokens)
        assert float((got - want).abs().mean()) < 0.06 * float(want.abs().mean())


def test_fp8_moe_layer_matches_its_dequantized_weights() -> None:
    """FusedMoE's fp8 forward on the CPU computes with exactly its dequantized weights."""
    from pagedserve.kernels.attention_backends import torch_ref_backend
    from pagedserve.models.layer_config import LayerConfig
    from pagedserve.models.moe import FusedMoE
    from pagedserve.models.quantization.config import Fp8Scheme, QuantizationConfig

    quantization = QuantizationConfig("fp8", Fp8Scheme("float"))
    config = LayerConfig(CPU, torch.float32, torch_ref_backend(), quantization=quantization)
    layer = FusedMoE(num_experts=4, hidden_size=32, intermediate_size=16, config=config)
    gen = torch.Generator().manual_seed(0)
    layer.w13.data.copy_(torch.randn(4, 32, 32, generator=gen))
    layer.w2.data.copy_(torch.randn(4, 32, 16, generator=gen))
    layer.process_weights_after_loading()
    x = torch.randn(5, 32, generator=gen)
    weights, ids = (
        torch.rand(5, 2, generator=gen),
        torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2], [3, 0]]),
    )
    w13 = layer.w13.float() * layer.w13_scale[..., None]
    w2 = layer.w2.float() * layer.w2_scale[..., None]
    torch.testing.assert_close(
        layer(x, weights, ids), moe_ref.fused_experts(x, w13, w2, weights, ids)
    )
