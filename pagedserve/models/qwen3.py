"""Qwen3 (dense): the Llama decoder with a per-head RMSNorm on q and k before rotary, no bias
by default (`attention_bias`), and head_dim read from the config."""

from __future__ import annotations

from pagedserve.models.layer_config import LayerConfig
from pagedserve.models.layers import RMSNorm, RotaryEmbedding
from pagedserve.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)
from pagedserve.models.model_config import ModelConfig


class Qwen3Attention(LlamaAttention):
    def __init__(
        self,
        config: ModelConfig,
        layer_config: LayerConfig,
        rotary_emb: RotaryEmbedding,
        window: int = 0,
    ) -> None:
        super().__init__(config, layer_config, rotary_emb, window)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, layer_config)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, layer_config)
        self.qk_norms = (self.q_norm, self.k_norm)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention


class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    attention_cls = Qwen3Attention
