"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's differences.

* RMSNorm scales by (1 + w): the loader stores 1 + w (`GemmaRMSNorm`), so every RMSNorm
  path (Triton, C++, torch) runs unchanged;
* four norms a layer: input, post-attention (on the attention's output, before the residual
  add), pre-feed-forward and post-feed-forward;
* the embedding times sqrt(hidden_size) (rounded to the model's dtype, as transformers);
* attention scaled by query_pre_attn_scalar^-1/2, a sliding window on the layers the config
  makes sliding (models.model_config.sliding_windows), Gemma 2's attention logit softcap
  (kernels.attention_ref's doc); Gemma 3 adds a (1 + w) RMSNorm per head on q and k and gives
  its sliding layers their own RoPE base (`rope_local_base_freq`, or transformers 5's
  per-layer-type `rope_parameters`);
* the GeGLU feed-forward (gelu, tanh approximation), and Gemma 2's final logit softcap
  c tanh(logits / c).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.models.layer_config import LayerConfig
from pagedserve.models.layers import GeluTanhAndMul, RMSNorm, RotaryEmbedding
from pagedserve.models.linear import MergedColumnParallelLinear, RowParallelLinear
from pagedserve.models.llama import (
    BuildMLP,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    rope_settings,
    rotary_dim,
)
from pagedserve.models.model_config import ModelConfig, context_limit
from pagedserve.models.weights import default_weight_loader


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint weight w scales as (1 + w): the parameter holds 1 + w."""

    def __init__(self, hidden_size: int, eps: float, config: LayerConfig) -> None:
        super().__init__(hidden_size, eps, config)
        self.weight.weight_loader = load_one_plus  # type: ignore[attr-defined]


def load_one_plus(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """param = 1 + the checkpoint's weight (computed in float32)."""
    default_weight_loader(param, loaded.float() + 1.0)


def gemma_rope(config: ModelConfig, sliding: bool) -> tuple[float, dict | None]:
    """(rope_theta, scaling) of a layer: Gemma 3's per-layer-type `rope_parameters`, or its
    older fields (`rope_local_base_freq` for sliding layers; `rope_theta` and `rope_scaling`
    for the others); Gemma 2's are Llama's."""
    if config.model_type == "gemma2":
        return rope_settings(config)
    kind = "sliding_attention" if sliding else "full_attention"
    params = dict((getattr(config, "rope_parameters", None) or {}).get(kind) or {})
    if not params:
        if sliding:
            params = {"rope_theta": getattr(config, "rope_local_base_freq", None) or 10000.0}
        else:
            scaling = getattr(config, "rope_scaling", None) or {}
            params = {"rope_theta": getattr(config, "rope_theta", None) or 1e6, **scaling}
    theta = float(params.pop("rope_theta", 10000.0))
    if params.get("rope_type", params.get("type", "default")) == "default":
        return theta, None
    return theta, params


class GemmaAttention(LlamaAttention):
    def __init__(
        self,
        config: ModelConfig,
        layer_config: LayerConfig,
        rotary_emb: RotaryEmbedding,
        window: int = 0,
    ) -> None:
        super().__init__(config, layer_config, rotary_emb, window)
        if config.model_type != "gemma2":  # Gemma 3: q / k norms
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, layer_config)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, layer_config)
            self.qk_norms = (self.q_norm, self.k_norm)

    def attention_scale(self, config: ModelConfig) -> float:
        return float(getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5

    def attention_options(self, config: ModelConfig) -> dict[str, float | bool]:
        return {"softcap": float(getattr(config, "attn_logit_softcapping", None) or 0.0)}


class GemmaMLP(nn.Module):
    def __init__(self, config: ModelConfig, layer_config: LayerConfig) -> None:
        super().__init__()
        activation = getattr(config, "hidden_activation", None) or config.hidden_act
        if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise NotImplementedError(f"hidden_activation {activation!r} is not supported")
        size, hidden = config.intermediate_size, config.hidden_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [size, size], layer_config)
        self.down_proj = RowParallelLinear(size, hidden, layer_config)
        self.act_fn = GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaDecoderLayer(LlamaDecoderLayer):
    """The Llama layer with (1 + w) norms, and two more around the feed-forward: the
    attention's output normed before the residual add, the feed-forward's after."""

    norm_cls = GemmaRMSNorm

    def __init__(
        self,
        config: ModelConfig,
        layer_config: LayerConfig,
        attention_cls: type[GemmaAttention],
        rotary_emb: RotaryEmbedding,
        mlp: nn.Module,
        window: int,
    ) -> None:
        super().__init__(config, layer_config, attention_cls, rotary_emb, mlp, window)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, layer_config)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, layer_config)

    def feed_forward(
        self, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(LlamaModel):
    """LlamaModel with Gemma's layers and norms, the embedding times sqrt(hidden_size) (rounded
    to the model's dtype, as transformers multiplies by it), and Gemma 3's two RoPE settings."""

    decoder_layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm

    def __init__(
        self,
        config: ModelConfig,
        layer_config: LayerConfig,
        attention_cls: type[LlamaAttention],
        build_mlp: BuildMLP,
    ) -> None:
        super().__init__(config, layer_config, attention_cls, build_mlp)
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=layer_config.dtype).item()

    def build_rotary_embs(
        self, config: ModelConfig, layer_config: LayerConfig, windows: list[int]
    ) -> dict[str, RotaryEmbedding]:
        """One by whether a layer slides (Gemma 3's settings differ; Gemma 2's do not)."""
        limit = context_limit(config.to_dict())
        return {
            str(sliding): RotaryEmbedding(
                rotary_dim(config), limit, *gemma_rope(config, sliding), layer_config
            )
            for sliding in sorted({bool(w) for w in windows})
        }

    def layer_rotary_emb(self, window: int) -> RotaryEmbedding:
        return self.rotary_embs[str(bool(window))]


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (the text model; its LM head is tied)."""

    model_cls = GemmaModel
    attention_cls = GemmaAttention

    def __init__(self, config: ModelConfig, layer_config: LayerConfig) -> None:
        if getattr(config, "use_bidirectional_attention", None):
            raise NotImplementedError("Gemma with bidirectional attention is not supported")
        super().__init__(config, layer_config)
        self.final_softcap = float(getattr(config, "final_logit_softcapping", None) or 0.0)

    @staticmethod
    def build_mlp(config: ModelConfig, layer_config: LayerConfig, index: int) -> nn.Module:
        return GemmaMLP(config, layer_config)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
