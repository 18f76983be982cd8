"""Phi-3 / Phi-4 (Phi3ForCausalLM) against transformers' Phi3ForCausalLM, float32 on the CPU:
tiny random models with the checkpoints' fused qkv_proj / gate_up_proj, partial rotary and
LongRoPE, driven through ModelRunner (test_model_parity's MiniScheduler: batched, one prefill
chunked), through the engine (a prefix-cache hit), and over two tensor-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve import LLM
from pagedserve import SamplingParams as EngineSamplingParams
from pagedserve.config import EngineConfig
from pagedserve.kernels.attention_backends import torch_ref_backend
from pagedserve.models.layer_config import LayerConfig, TensorParallel
from pagedserve.models.layers import RotaryEmbedding
from pagedserve.models.linear import MergedColumnParallelLinear, QKVParallelLinear
from pagedserve.models.llama import rope_settings, rotary_dim
from pagedserve.models.model_config import (
    ModelConfig,
    context_limit,
    load_model_config,
    sliding_windows,
)
from pagedserve.models.weights import ALL_PARTS
from tests.engine_settings import NO_STANDBY
from tests.test_model_parity import (
    COMMON,
    assert_greedy_matches,
    assert_two_ranks_match_one,
    make_runner,
    random_prompts,
)
from tests.tiny_models import hf_greedy

ORIGINAL_CONTEXT = 32  # LongRoPE's original_max_position_embeddings at this scale
LONG_PROMPT_LENGTHS = [33, 40, 57, 34, 48, 45, 70, 60]  # all past ORIGINAL_CONTEXT
PARTIAL = 0.75  # Phi-4-mini's partial_rotary_factor: 12 of the 16 head dims rotate


def longrope_factors(seed: int) -> list[float]:
    """One factor per rotated frequency (6 here), far from 1 so that the choice shows."""
    gen = torch.Generator().manual_seed(seed)
    return (1.0 + 3.0 * torch.rand(6, generator=gen)).tolist()


LONGROPE = dict(
    rope_type="longrope", short_factor=longrope_factors(1), long_factor=longrope_factors(2)
)
SPECIAL_TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # inside the vocabulary
HF_CONFIGS = {
    # Phi-3-mini-4k / Phi-4: full rotary, untied LM head
    "phi3": lambda: transformers.Phi3Config(**COMMON, **SPECIAL_TOKENS),
    # Phi-4-mini at a tiny scale: partial rotary, LongRoPE, tied embeddings
    "phi4-mini": lambda: transformers.Phi3Config(
        **COMMON | {"max_position_embeddings": 256},
        **SPECIAL_TOKENS,
        original_max_position_embeddings=ORIGINAL_CONTEXT,
        partial_rotary_factor=PARTIAL,
        rope_scaling=dict(LONGROPE),
        tie_word_embeddings=True,
    ),
}


@dataclass
class TinyPhi3:
    """A saved tiny model, transformers' copy of it and its greedy results so far (a test
    module's engines share them)."""

    path: Path
    hf_model: transformers.PreTrainedModel
    greedy_results: dict[tuple[tuple[int, ...], int], tuple[list[int], list[float]]] = field(
        default_factory=dict
    )

    def greedy(self, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """transformers' greedy tokens and their logprobs (tiny_models.hf_greedy), once."""
        key = (tuple(prompt), max_tokens)
        if key not in self.greedy_results:
            self.greedy_results[key] = hf_greedy(self.hf_model, prompt, max_tokens)
        return self.greedy_results[key]


def save_phi3(arch: str, path: Path) -> TinyPhi3:
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(HF_CONFIGS[arch]()).float().eval()
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None  # greedy runs to max tokens
    return TinyPhi3(path, model)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> TinyPhi3:
    return save_phi3("phi3", tmp_path_factory.mktemp("phi3"))


@pytest.fixture(scope="module")
def phi4_mini(tmp_path_factory: pytest.TempPathFactory) -> TinyPhi3:
    return save_phi3("phi4-mini", tmp_path_factory.mktemp("phi4-mini"))


def assert_greedy_parity(model: TinyPhi3, prompts: list[list[int]], **overrides: object) -> None:
    """The runner's greedy tokens are transformers', its logprobs within LOGPROB_ATOL."""
    assert_greedy_matches(make_runner(model.path, **overrides), prompts, model.greedy)


def test_phi3_greedy_parity_with_transformers(phi3: TinyPhi3) -> None:
    """Fused checkpoint tensors split into the fused layers, full rotary, untied head."""
    assert_greedy_parity(phi3, random_prompts(seed=3))


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
def test_partial_rotary_and_long_factors_match_transformers(
    phi4_mini: TinyPhi3, cpu_kernels: bool
) -> None:
    """Partial rotary (the C++ kernel, or torch, on the rotated dims only) and LongRoPE's long
    factors: max_model_len (256) exceeds the original context, and every prompt does too, where
    transformers also takes the long factors."""
    prompts = [[(7 * i + 3 * n) % COMMON["vocab_size"] for i in range(n)]
               for n in LONG_PROMPT_LENGTHS]  # fmt: skip
    assert_greedy_parity(phi4_mini, prompts, cpu_kernels=cpu_kernels)


@pytest.mark.parametrize("max_model_len", [ORIGINAL_CONTEXT, 256])
def test_longrope_factors_follow_max_model_len(phi4_mini: TinyPhi3, max_model_len: int) -> None:
    """The short factors where the engine's context fits the original one, else the long ones
    (vLLM's choice): the cos/sin tables (attention factor included) are transformers' for a
    sequence of that length."""
    config = load_model_config(str(phi4_mini.path))
    theta, scaling = rope_settings(config)
    layer_config = LayerConfig(
        torch.device("cpu"), torch.float32, torch_ref_backend(), max_model_len=max_model_len
    )
    rotary = RotaryEmbedding(
        rotary_dim(config), context_limit(config.to_dict()), theta, scaling, layer_config
    )
    positions = torch.arange(max_model_len)[None]
    hf_cos, hf_sin = phi4_mini.hf_model.model.rotary_emb(torch.zeros(1), positions)
    half = rotary.rotary_dim // 2
    assert rotary.rotary_dim == int(16 * PARTIAL)
    torch.testing.assert_close(rotary.cos_cache[:max_model_len], hf_cos[0, :, :half])
    torch.testing.assert_close(rotary.sin_cache[:max_model_len], hf_sin[0, :, :half])


def test_model_config_reads_phi3_as_transformers_does(tmp_path: Path) -> None:
    """A bare Phi-3 config.json takes Phi3Config's defaults; an old "su" LongRoPE config reads as
    "longrope", its original context taken from beside the RoPE fields."""
    bare = {"model_type": "phi3", "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 1, "intermediate_size": 32, "vocab_size": 16}  # fmt: skip
    ours, reference = ModelConfig(bare), transformers.Phi3Config(**bare)
    for name in ("num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
                 "original_max_position_embeddings", "tie_word_embeddings"):  # fmt: skip
        assert getattr(ours, name) == getattr(reference, name), name
    assert rope_settings(ours) == (10000.0, None) and rotary_dim(ours) == 16
    su = ModelConfig(
        bare | {"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                "rope_scaling": {"type": "su", "short_factor": [1.0] * 8,
                                 "long_factor": [2.0] * 8, "original_max_position_embeddings": 1}}
    )  # fmt: skip
    _, scaling = rope_settings(su)
    assert scaling is not None
    assert scaling["rope_type"] == "longrope"
    assert scaling["original_max_position_embeddings"] == 4096 and scaling["factor"] == 32.0


def test_sliding_window_is_every_layers(tmp_path: Path) -> None:
    """Phi-3-mini-4k sets sliding_window 2047 (no use_sliding_window field): as for Mistral,
    every layer attends within it over the model's whole context; disable_sliding_window caps
    the context to the window instead."""
    transformers.Phi3Config(**COMMON, sliding_window=47).save_pretrained(tmp_path)
    limit = COMMON["max_position_embeddings"]
    assert EngineConfig(model=str(tmp_path)).resolve().max_model_len == limit
    capped = EngineConfig(model=str(tmp_path), disable_sliding_window=True)
    assert capped.resolve().max_model_len == 47
    config = load_model_config(str(tmp_path))
    assert sliding_windows(config.to_dict()) == [47] * config.num_hidden_layers


def test_fused_checkpoint_tensors_shard_as_separate_ones() -> None:
    """Rank 1 of 2 takes from a fused [q; k; v] / [gate; up] tensor the rows it takes from the
    separate tensors (1 kv head a rank)."""
    config = LayerConfig(
        torch.device("cpu"), torch.float32, torch_ref_backend(), tp=TensorParallel(1, 2)
    )
    full_q, full_k, full_v = (torch.randn(n * 2, 4) for n in (4, 2, 2))
    qkv = QKVParallelLinear(hidden_size=4, head_dim=2, num_heads=4, num_kv_heads=2, config=config)
    qkv.weight_loader(qkv.weight, torch.cat((full_q, full_k, full_v)), ALL_PARTS)
    expected = QKVParallelLinear(4, 2, 4, 2, config)
    for shard_id, full in (("q", full_q), ("k", full_k), ("v", full_v)):
        expected.weight_loader(expected.weight, full, shard_id)
    assert torch.equal(qkv.weight, expected.weight)
    assert torch.equal(qkv.weight, torch.cat((full_q[4:], full_k[2:], full_v[2:])))
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    gate_up = MergedColumnParallelLinear(4, [6, 6], config)
    gate_up.weight_loader(gate_up.weight, torch.cat((gate, up)), ALL_PARTS)
    assert torch.equal(gate_up.weight, torch.cat((gate[3:], up[3:])))


def test_prefix_cache_hit_and_chunked_prefill_keep_transformers_tokens(
    phi4_mini: TinyPhi3,
) -> None:
    """Through the engine: a 70-token prompt prefilled in chunks of 32, then one sharing its
    first 64 tokens served from the prefix cache; both give transformers' greedy tokens."""
    shared = [(5 * i + 1) % COMMON["vocab_size"] for i in range(68)]
    prompts = [shared + [11, 12], shared + [99]]
    greedy = EngineSamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(
        str(phi4_mini.path), max_num_batched_tokens=32, num_kv_blocks=64, supervision=NO_STANDBY,
        skip_tokenizer_init=True,
    ) as llm:  # fmt: skip
        first = llm.generate([prompts[0]], greedy)[0]
        second = llm.generate([prompts[1]], greedy)[0]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 64)
    for prompt, output in zip(prompts, (first, second)):
        assert output.outputs[0].token_ids == phi4_mini.greedy(prompt, 16)[0]


def test_tensor_parallel_two_ranks_match_one(phi4_mini: TinyPhi3, tmp_path: Path) -> None:
    """Two gloo ranks (the fused tensors split and sharded by heads and rows, one kv head a
    rank, the tied vocabulary-parallel head) give the single-process tokens and logprobs."""
    assert_two_ranks_match_one(phi4_mini.path, tmp_path)
