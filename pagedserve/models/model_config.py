"""A model's config.json as attributes, read without transformers.

The worker builds the model from these attributes. Reading them through transformers'
AutoConfig imports its modelling stack (and torch.distributed with it), which on a fresh
machine costs the worker several seconds of start-up. Keys missing from the file take the
defaults of the matching transformers config class (`DEFAULTS`), for the fields the models
read (`num_key_value_heads` left unset means num_attention_heads for Llama, a fixed number for
the others, as there; `head_dim` unset means hidden_size // num_attention_heads, but 128 for
Qwen3).
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"  # a fast tokenizer, whole: its vocabulary among the rest
_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rope_parameters": None,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "head_dim": None,
    "sliding_window": None,
    "use_sliding_window": False,
}
# transformers' defaults per model_type (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config,
# Phi3Config, ...)
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {
        "max_position_embeddings": 4096 * 32,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
        "use_sliding_window": True,
    },
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128},
    "phi3": {
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
    },
    "gemma2": {
        "max_position_embeddings": 8192,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
    },
    "gemma3_text": {
        "max_position_embeddings": 131072,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "tie_word_embeddings": True,
    },
    "gpt_oss": {
        "max_position_embeddings": 131072,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "sliding_window": 128,
        "attention_bias": True,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    },
    "mixtral": {
        "max_position_embeddings": 4096 * 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "qwen2_moe": {
        "max_position_embeddings": 32768,
        "num_key_value_heads": 16,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "qwen3_moe": {
        "max_position_embeddings": 32768,
        "num_key_value_heads": 4,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
}


# fields whose explicit null in config.json means "none" rather than "the default": Mistral
# v0.2 on has no window ("sliding_window": null under MistralConfig's 4096), a Gemma 2 config
# may turn a softcap off
NULLABLE = ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping")


class ModelConfig:
    """Attribute access to config.json plus defaults; `to_dict()` gives them back."""

    def __init__(self, values: dict[str, Any]) -> None:
        model_type = values.get("model_type")
        defaults = _COMMON | DEFAULTS.get(str(model_type), {})
        merged = defaults | {
            k: v for k, v in values.items() if v is not None or k not in defaults or k in NULLABLE
        }
        if merged.get("num_key_value_heads") is None and "num_attention_heads" in merged:
            merged["num_key_value_heads"] = merged["num_attention_heads"]
        self.__dict__.update(merged)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"ModelConfig({self.__dict__})"


def num_experts(config: ModelConfig) -> int:
    """A mixture-of-experts model's expert count (`num_local_experts` in Mixtral's config and
    in what transformers 5 writes for the Qwen MoE models, `num_experts` in Qwen's files; 0 for
    a dense model)."""
    values = config.to_dict()
    return int(values.get("num_local_experts") or values.get("num_experts") or 0)


def load_model_config(model_path: str, overrides: dict[str, Any] | None = None) -> ModelConfig:
    """config.json with `overrides` (EngineConfig.hf_overrides) over its fields (and what
    they imply of a score head made from the LM head: `with_score_head_method`)."""
    with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
        return ModelConfig(with_score_head_method(json.load(f) | (overrides or {})))


def rope_scaling_of(values: dict[str, Any]) -> dict[str, Any]:
    """The RoPE fields: transformers 5's `rope_parameters`, with a legacy `rope_scaling` over
    them when the config (or an hf_overrides) sets one, as transformers 5 reads both."""
    params = dict(values.get("rope_parameters") or {})
    legacy = values.get("rope_scaling")
    if legacy:
        theta = {"rope_theta": params["rope_theta"]} if "rope_theta" in params else {}
        params = theta | dict(legacy)
    return params


def context_limit(values: dict[str, Any]) -> int:
    """The longest context a model's positions cover, as vLLM derives it: the config's
    max_position_embeddings, stretched by a linear or YaRN RoPE scaling factor (YaRN's from
    its original_max_position_embeddings)."""
    limit = int(values.get("max_position_embeddings") or 2048)
    scaling = rope_scaling_of(values)
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "yarn":
        limit = int(scaling.get("original_max_position_embeddings") or limit)
    if rope_type in ("linear", "yarn") and scaling.get("factor"):
        limit = int(limit * float(scaling["factor"]))
    return limit


def sliding_windows(values: dict[str, Any]) -> list[int]:
    """Each layer's sliding window (0: full attention), as transformers assigns them: from
    `layer_types` where the config lists them, else by model type: Gemma 2 and GPT-OSS every
    other layer from the first, Gemma 3 all but every `sliding_window_pattern`-th, Qwen2/Qwen3
    (where `use_sliding_window` is set) the layers from `max_window_layers` on, Mistral every
    layer."""
    num_layers = int(values.get("num_hidden_layers") or 0)
    window = int(values.get("sliding_window") or 0)
    layer_types = values.get("layer_types")
    if not window:
        return [0] * num_layers
    if layer_types is not None:
        return [window if kind == "sliding_attention" else 0 for kind in layer_types]
    model_type = values.get("model_type")
    if model_type in ("gemma2", "gpt_oss"):
        return [window if i % 2 == 0 else 0 for i in range(num_layers)]
    if model_type in ("gemma3", "gemma3_text"):
        pattern = int(values.get("sliding_window_pattern") or 6)
        return [window if (i + 1) % pattern else 0 for i in range(num_layers)]
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if not values.get("use_sliding_window"):
            return [0] * num_layers
        first = int(values.get("max_window_layers", 28))  # transformers' default
        return [window if i >= first else 0 for i in range(num_layers)]
    return [window] * num_layers


def uses_windowed_attention(values: dict[str, Any], disable_sliding_window: bool) -> bool:
    """Whether some layer attends within a sliding window (unless disabled), caps its
    attention logits (Gemma 2's `attn_logit_softcapping`) or has attention sinks (GPT-OSS)."""
    windows = not disable_sliding_window and any(sliding_windows(values))
    sinks = values.get("model_type") == "gpt_oss"
    return windows or sinks or bool(values.get("attn_logit_softcapping"))


def active_sliding_window(values: dict[str, Any]) -> int | None:
    """The sliding window some of the model's layers attend within (None: every layer attends
    over the whole context): Mistral's `sliding_window`, Qwen2/Qwen3's where
    `use_sliding_window` is set, or layers that `layer_types` (or Gemma's pattern) makes
    sliding."""
    return max(sliding_windows(values), default=0) or None


def is_sequence_classifier(values: dict[str, Any]) -> bool:
    """Whether config.json names a sequence-classification model (`*ForSequenceClassification`:
    the decoder with a `score` head over its last token instead of an LM head)."""
    return any(
        name.endswith("ForSequenceClassification") for name in values.get("architectures") or []
    )


TASK_NAMES = {"generate": "generation", "embed": "embeddings", "classify": "classification"}


def supported_tasks(values: dict[str, Any]) -> tuple[str, ...]:
    """What requests the model serves, vLLM's task names: a sequence-classification model
    classifies only; a causal LM generates and embeds."""
    return ("classify",) if is_sequence_classifier(values) else ("generate", "embed")


def check_task(values: dict[str, Any], task: str) -> None:
    """A ValueError, naming what the model serves, unless it serves `task`."""
    tasks = supported_tasks(values)
    if task not in tasks:
        model = "/".join(values.get("architectures") or []) or "this model"
        served = " and ".join(TASK_NAMES[name] for name in tasks)
        raise ValueError(f"{model} serves {served}, not {TASK_NAMES[task]}")


def class_labels(values: dict[str, Any]) -> list[str]:
    """A classifier's labels in index order, as transformers reads them: config.json's
    `id2label` (keys are the indices, as strings), else `num_labels` of LABEL_i (2 unless
    told)."""
    id2label = values.get("id2label")
    if id2label:
        return [str(id2label[key]) for key in sorted(id2label, key=int)]
    return [f"LABEL_{index}" for index in range(int(values.get("num_labels") or 2))]


# vLLM's ways to make a causal LM's score head from its LM head's rows of some tokens
# (hf_overrides' `method`, with `classifier_from_token`): the row of tokens[1] minus that of
# tokens[0] as one label (sigmoid(score) = softmax([logit_0, logit_1])[1]), or each token's row
# as a label of its own
SCORE_HEAD_METHODS = ("from_2_way_softmax", "no_post_processing")


def score_head_method(values: dict[str, Any]) -> str | None:
    """How a sequence classifier's score head is made from its LM head (vLLM's `method`;
    `is_original_qwen3_reranker` means from_2_way_softmax for Qwen3ForSequenceClassification),
    None for a checkpoint's own head; a ValueError for overrides vLLM refuses."""
    method = values.get("method")
    tokens = values.get("classifier_from_token")
    qwen3 = "Qwen3ForSequenceClassification" in (values.get("architectures") or [])
    if method is None and qwen3 and values.get("is_original_qwen3_reranker"):
        method = "from_2_way_softmax"
    if method is None and tokens is None:
        return None
    if method not in SCORE_HEAD_METHODS:
        raise ValueError(
            f"classifier_from_token needs a method, one of {', '.join(SCORE_HEAD_METHODS)} "
            f"(or is_original_qwen3_reranker for Qwen3ForSequenceClassification), got {method!r}"
        )
    if not is_sequence_classifier(values):
        raise ValueError(f"method {method!r} needs a *ForSequenceClassification architecture")
    if not tokens or not all(isinstance(token, str) for token in tokens):
        raise ValueError(f"method {method!r} needs classifier_from_token, a list of tokens")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError("from_2_way_softmax needs two tokens in classifier_from_token")
    return method


def with_score_head_method(values: dict[str, Any]) -> dict[str, Any]:
    """The config as vLLM updates it for a score head made from the LM head: one label for
    from_2_way_softmax, one a token otherwise (named LABEL_i), and no separator between a
    pair's texts unless the config says so (`use_sep_token`)."""
    method = score_head_method(values)
    if method is None:
        return values
    num_labels = 1 if method == "from_2_way_softmax" else len(values["classifier_from_token"])
    return values | {
        "method": method,
        "num_labels": num_labels,
        "id2label": {str(index): f"LABEL_{index}" for index in range(num_labels)},
        "use_sep_token": values.get("use_sep_token", False),
    }


def uses_sep_token(values: dict[str, Any]) -> bool:
    """Whether a cross-encoder's pair is encoded as the tokenizer encodes a text pair (with
    its separator: vLLM's default for a sequence classifier), rather than as the two texts
    joined (an LLM as reranker); vLLM's deprecated `use_pad_token` wins where set."""
    use_pad_token = values.get("use_pad_token")
    if use_pad_token is not None:
        return bool(use_pad_token)
    return bool(values.get("use_sep_token", True))


def classifier_token_ids(tokenizer_path: str, tokens: list[str]) -> list[int]:
    """The vocabulary ids of `tokens` (vLLM's `convert_tokens_to_ids` of `classifier_from_token`),
    read from the tokenizer's tokenizer.json by the Rust tokenizers library: the worker, which
    makes the score head at load, never loads a transformers tokenizer. A ValueError names a
    token the vocabulary lacks."""
    path = os.path.join(tokenizer_path, TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"classifier_from_token looks its tokens up in the tokenizer's {TOKENIZER_FILE}, "
            f"which {tokenizer_path} lacks"
        )
    vocabulary = Tokenizer.from_file(path)
    ids = [vocabulary.token_to_id(token) for token in tokens]
    missing = [token for token, token_id in zip(tokens, ids) if token_id is None]
    if missing:
        raise ValueError(f"classifier_from_token: {missing} not in the tokenizer's vocabulary")
    return ids  # type: ignore[return-value]
