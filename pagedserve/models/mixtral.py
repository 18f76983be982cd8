"""Mixtral: the Mistral decoder with a mixture of experts (`num_local_experts` SwiGLU experts,
the top `num_experts_per_tok` of them per token, their weights renormalised) in every layer."""

from __future__ import annotations

from torch import nn

from pagedserve.models.layer_config import LayerConfig
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.model_config import ModelConfig, num_experts
from pagedserve.models.moe import MIXTRAL_EXPERTS, SparseMoeBlock


class MixtralForCausalLM(LlamaForCausalLM):
    expert_params_mapping = MIXTRAL_EXPERTS
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}

    @staticmethod
    def build_mlp(config: ModelConfig, layer_config: LayerConfig, index: int) -> nn.Module:
        moe = (num_experts(config), config.num_experts_per_tok, config.intermediate_size)
        return SparseMoeBlock(config.hidden_size, moe, True, layer_config)
