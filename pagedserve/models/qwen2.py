"""Qwen2 / Qwen2.5: the Llama decoder with a bias on q, k and v (none on o_proj)."""

from __future__ import annotations

from transformers import PretrainedConfig

from pagedserve.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    def qkv_bias(self, config: PretrainedConfig) -> bool:
        return True

    def o_proj_bias(self, config: PretrainedConfig) -> bool:
        return False


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention
