"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 decoders whose feed-forward is a mixture of
experts in every `decoder_sparse_step`-th layer not listed in `mlp_only_layers` (a dense MLP
there): `num_experts` SwiGLU experts of `moe_intermediate_size`, the top `num_experts_per_tok`
per token, renormalised when `norm_topk_prob`. Qwen2-MoE adds a gated shared expert."""

from __future__ import annotations

from torch import nn

from pagedserve.models.layer_config import LayerConfig
from pagedserve.models.llama import LlamaForCausalLM, LlamaMLP
from pagedserve.models.model_config import ModelConfig, num_experts
from pagedserve.models.moe import QWEN_EXPERTS, SparseMoeBlock
from pagedserve.models.qwen2 import Qwen2Attention
from pagedserve.models.qwen3 import Qwen3Attention


def is_sparse_layer(config: ModelConfig, index: int) -> bool:
    step = config.decoder_sparse_step or 1
    return (
        num_experts(config) > 0
        and index not in (config.mlp_only_layers or [])
        and (index + 1) % step == 0
    )


def qwen_moe_mlp(
    config: ModelConfig, layer_config: LayerConfig, index: int, shared_expert: bool
) -> nn.Module:
    if not is_sparse_layer(config, index):
        return LlamaMLP(config, layer_config)
    shared = None
    if shared_expert:
        shared = LlamaMLP(config, layer_config, config.shared_expert_intermediate_size)
    moe = (num_experts(config), config.num_experts_per_tok, config.moe_intermediate_size)
    return SparseMoeBlock(config.hidden_size, moe, config.norm_topk_prob, layer_config, shared)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention
    expert_params_mapping = QWEN_EXPERTS

    @staticmethod
    def build_mlp(config: ModelConfig, layer_config: LayerConfig, index: int) -> nn.Module:
        return qwen_moe_mlp(config, layer_config, index, shared_expert=True)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
    expert_params_mapping = QWEN_EXPERTS

    @staticmethod
    def build_mlp(config: ModelConfig, layer_config: LayerConfig, index: int) -> nn.Module:
        return qwen_moe_mlp(config, layer_config, index, shared_expert=False)
