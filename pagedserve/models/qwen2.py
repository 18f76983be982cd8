"""Qwen2 / Qwen2.5: the Llama decoder with a bias on q, k and v (none on o_proj); as a causal LM
and as a sequence classifier."""

from __future__ import annotations

from pagedserve.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)
from pagedserve.models.model_config import ModelConfig


class Qwen2Attention(LlamaAttention):
    def qkv_bias(self, config: ModelConfig) -> bool:
        return True

    def o_proj_bias(self, config: ModelConfig) -> bool:
        return False


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention


class Qwen2ForSequenceClassification(LlamaForSequenceClassification):
    attention_cls = Qwen2Attention
