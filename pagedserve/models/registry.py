"""Hugging Face `architectures` name -> pagedserve model class (imported on first use)."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "Gemma2ForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "GemmaForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen_moe", "Qwen3MoeForCausalLM"),
    # sequence classifiers: a score head instead of the LM head, pooling requests only
    "LlamaForSequenceClassification": ("llama", "LlamaForSequenceClassification"),
    "MistralForSequenceClassification": ("llama", "LlamaForSequenceClassification"),
    "Qwen2ForSequenceClassification": ("qwen2", "Qwen2ForSequenceClassification"),
    "Qwen3ForSequenceClassification": ("qwen3", "Qwen3ForSequenceClassification"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """The class for the first supported name in a config's `architectures` list."""
    for name in architectures or []:
        if name in _MODELS:
            module_name, class_name = _MODELS[name]
            module = importlib.import_module(f"pagedserve.models.{module_name}")
            return getattr(module, class_name)
    raise ValueError(
        f"unsupported architectures {architectures}; supported: {supported_architectures()}"
    )
