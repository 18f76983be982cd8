"""Llama (2, 3, 3.1 rope scaling) and Mistral, written against the shared layer set, as causal
LMs and as sequence classifiers (a `score` head instead of the LM head).

The decoder pieces here are reused by the other architectures: a model subclass swaps the
attention class (`attention_cls`), which overrides one of its small hooks (biases) or sets
`qk_norms` (Qwen3's per-head q/k RMSNorm), and the feed-forward of each layer (`build_mlp`: a
mixture of experts in Mixtral and the Qwen MoE models, models/moe.py). A pipeline stage
(layer_config.stage) builds only its part of the model (models/stages.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedserve.kernels.attention_metadata import AttentionMetadata, OutputRows
from pagedserve.models.layer_config import LayerConfig
from pagedserve.models.layers import Attention, RMSNorm, RotaryEmbedding, SiluAndMul
from pagedserve.models.linear import (
    LMHead,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabEmbedding,
)
from pagedserve.models.model_config import (
    ModelConfig,
    class_labels,
    context_limit,
    rope_scaling_of,
    sliding_windows,
)
from pagedserve.models.stages import MissingLayer, StageActivations, lm_head_is_tied


def model_head_dim(config: ModelConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_dim(config: ModelConfig) -> int:
    """The dims of each head that rotary turns: head_dim times `partial_rotary_factor` (the
    RoPE parameters' or the config's, as transformers reads it; 1 unless told)."""
    factor = rope_scaling_of(config.to_dict()).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None) or 1.0
    return int(model_head_dim(config) * factor)


def rope_settings(config: ModelConfig) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict) from transformers 5 `rope_parameters` or the older fields
    (the partial rotary factor left to `rotary_dim`); YaRN's and LongRoPE's ("su" in older
    Phi-3 configs) original_max_position_embeddings and factor filled in as transformers does."""
    params = rope_scaling_of(config.to_dict())
    params.pop("partial_rotary_factor", None)
    theta = params.pop("rope_theta", None) or getattr(config, "rope_theta", None) or 10000.0
    if params == {"rope_type": "default"}:  # what transformers 5 fills in for no scaling
        params = {}
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type == "su":
        params["rope_type"] = rope_type = "longrope"
    if rope_type in ("yarn", "longrope"):
        original = params.get("original_max_position_embeddings")
        if rope_type == "longrope":  # Phi-3 keeps it beside the RoPE fields, and that wins
            original = getattr(config, "original_max_position_embeddings", None) or original
        params["original_max_position_embeddings"] = original or config.max_position_embeddings
        if params.get("factor") is None:
            params["factor"] = (
                config.max_position_embeddings / params["original_max_position_embeddings"]
            )
    return float(theta), params or None


def layer_windows(config: ModelConfig, layer_config: LayerConfig) -> list[int]:
    """Each decoder layer's sliding window (0: full attention; all 0 where the engine disables
    sliding windows)."""
    windows = sliding_windows(config.to_dict())
    if not layer_config.sliding_window or len(windows) != config.num_hidden_layers:
        return [0] * config.num_hidden_layers
    return windows


class LlamaAttention(nn.Module):
    """qkv projection, rotary on q and k (after a per-head RMSNorm when `qk_norms` is set),
    paged attention (within a sliding `window` when > 0), o_proj. A subclass changes the
    biases (`qkv_bias`, `o_proj_bias`), the attention's scale (`attention_scale`) and its
    other options (`attention_options`: Gemma 2's softcap, GPT-OSS's sinks)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_config: LayerConfig,
        rotary_emb: RotaryEmbedding,
        window: int = 0,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim = model_head_dim(config)
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, num_heads, num_kv_heads, layer_config,
            bias=self.qkv_bias(config),
        )  # fmt: skip
        self.o_proj = RowParallelLinear(
            num_heads * head_dim, config.hidden_size, layer_config, bias=self.o_proj_bias(config)
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.rotary_emb = rotary_emb  # shared by every layer
        self.attn = Attention(
            self.num_heads, head_dim, self.attention_scale(config), self.num_kv_heads,
            layer_config, window, **self.attention_options(config),
        )  # fmt: skip
        # (q_norm, k_norm) applied per head before rotary, or None; a subclass registers the
        # modules themselves (their parameters) and points this at them (see Qwen3Attention)
        self.qk_norms: tuple[RMSNorm, RMSNorm] | None = None

    def qkv_bias(self, config: ModelConfig) -> bool:
        return bool(getattr(config, "attention_bias", False))

    def o_proj_bias(self, config: ModelConfig) -> bool:
        return bool(getattr(config, "attention_bias", False))

    def attention_scale(self, config: ModelConfig) -> float:
        return self.head_dim**-0.5

    def attention_options(self, config: ModelConfig) -> dict[str, float | bool]:
        """Attention's keyword options beyond the window (none for Llama)."""
        return {}

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        metadata: AttentionMetadata,
        output_rows: OutputRows | None = None,
    ) -> torch.Tensor:
        """[T, hidden] -> [T, hidden], or [n, hidden] for output_rows (see Attention)."""
        qk_size = self.qkv_proj.q_size + self.qkv_proj.kv_size
        qkv = self.qkv_proj(hidden)
        v = qkv[:, qk_size:]
        # q and k side by side, [T, heads + kv_heads, head_dim]: one pass over both (in place
        # where it can: qkv is this step's own buffer)
        qk = qkv[:, :qk_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        kv_write = self.attn.fusable_kv_write(v, metadata)
        q, k, kv_written = self.rotary_emb.norm_rotate_qk(
            positions, qk, self.num_heads, self.qk_norms, kv_write
        )
        return self.o_proj(self.attn(q, k, v, metadata, output_rows, kv_written))


class LlamaMLP(nn.Module):
    """The SwiGLU feed-forward, of config.intermediate_size unless told (a shared expert's)."""

    def __init__(
        self, config: ModelConfig, layer_config: LayerConfig, intermediate_size: int | None = None
    ) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} is not supported")
        bias = bool(getattr(config, "mlp_bias", False))
        size, hidden = intermediate_size or config.intermediate_size, config.hidden_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [size, size], layer_config, bias)
        self.down_proj = RowParallelLinear(size, hidden, layer_config, bias)
        self.act_fn = SiluAndMul(layer_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


# (config, layer_config, layer index) -> that decoder layer's feed-forward module
BuildMLP = Callable[[ModelConfig, LayerConfig, int], nn.Module]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and feed-forward; a subclass (Gemma) changes the norm class and what
    follows the attention (`feed_forward`)."""

    norm_cls: type[RMSNorm] = RMSNorm

    def __init__(
        self,
        config: ModelConfig,
        layer_config: LayerConfig,
        attention_cls: type[LlamaAttention],
        rotary_emb: RotaryEmbedding,
        mlp: nn.Module,
        window: int = 0,
    ) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, layer_config, rotary_emb, window)
        self.mlp = mlp
        eps = config.rms_norm_eps
        self.input_layernorm = self.norm_cls(config.hidden_size, eps, layer_config)
        self.post_attention_layernorm = self.norm_cls(config.hidden_size, eps, layer_config)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
        output_rows: OutputRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """output_rows: after caching every row's k/v, go on with those rows only."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, metadata, output_rows)
        if output_rows is not None:
            residual = residual.index_select(0, output_rows.indices)
        return self.feed_forward(hidden, residual)

    def feed_forward(
        self, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the attention's output, the residual) -> the layer's (hidden, residual)."""
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """The decoder stack of one pipeline stage. A subclass (Gemma) changes the decoder layer
    and norm classes, the embedding's scale, and the rotary embeddings (`build_rotary_embs`,
    `layer_rotary_emb`: one per RoPE setting the layers use)."""

    decoder_layer_cls: type[nn.Module] = LlamaDecoderLayer
    norm_cls: type[RMSNorm] = RMSNorm

    def __init__(
        self,
        config: ModelConfig,
        layer_config: LayerConfig,
        attention_cls: type[LlamaAttention],
        build_mlp: BuildMLP,
    ) -> None:
        super().__init__()
        self.stage = stage = layer_config.stage
        self.embed_tokens: VocabEmbedding | None = None
        if stage.is_first:
            self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, layer_config)
        self.embed_scale: float | None = None  # what the embedding is multiplied by (Gemma)
        windows = layer_windows(config, layer_config)
        # rotary embeddings shared by the layers, whose per-step tables each forward resets
        self.rotary_embs = nn.ModuleDict(self.build_rotary_embs(config, layer_config, windows))
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(
                config,
                layer_config,
                attention_cls,
                self.layer_rotary_emb(windows[index]),
                build_mlp(config, layer_config, index),
                windows[index],
            )  # fmt: skip
            if stage.owns_layer(index)
            else MissingLayer()
            for index in range(config.num_hidden_layers)
        )
        self.own_layers = [i for i in range(len(self.layers)) if stage.owns_layer(i)]
        self.norm: RMSNorm | None = None
        if stage.is_last:
            self.norm = self.norm_cls(config.hidden_size, config.rms_norm_eps, layer_config)

    def build_rotary_embs(
        self, config: ModelConfig, layer_config: LayerConfig, windows: list[int]
    ) -> dict[str, RotaryEmbedding]:
        """The rotary embeddings by name: Llama's one, shared by every layer."""
        theta, scaling = rope_settings(config)
        limit = context_limit(config.to_dict())
        return {"all": RotaryEmbedding(rotary_dim(config), limit, theta, scaling, layer_config)}

    def layer_rotary_emb(self, window: int) -> RotaryEmbedding:
        """The rotary embedding of a layer with this sliding window (0: none)."""
        return self.rotary_embs["all"]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        received: StageActivations | None = None,
    ) -> torch.Tensor | StageActivations:
        """The final hidden states (last stage), else this stage's activations for the next;
        a stage after the first starts from the previous stage's (`received`)."""
        for rotary_emb in self.rotary_embs.values():
            rotary_emb.new_step()  # this forward's first layer looks its tables up again
        if self.embed_tokens is not None:
            hidden, residual = self.embed_tokens(input_ids), None
            if self.embed_scale is not None:
                hidden = hidden * self.embed_scale
        else:
            assert received is not None, "a stage after the first needs the previous one's"
            hidden, residual = received.hidden, received.residual
        last = len(self.layers) - 1
        for index in self.own_layers:
            rows = metadata.output_rows if index == last else None
            hidden, residual = self.layers[index](positions, hidden, residual, metadata, rows)
        if self.norm is None:
            return StageActivations(hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    model_cls: type[LlamaModel] = LlamaModel
    attention_cls: type[LlamaAttention] = LlamaAttention
    # checkpoint projection name of one expert -> (stacked parameter, part): MoE models'
    # (models.moe.expert_target)
    expert_params_mapping: dict[str, tuple[str, int | None]] = {}
    # checkpoint module names the model's modules differ from (".block_sparse_moe." -> ".mlp.")
    checkpoint_renames: dict[str, str] = {}
    # HF checkpoint name -> (fused parameter's module name, shard id for its weight_loader)
    packed_modules_mapping: dict[str, tuple[str, str | int]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    # whether the model has an LM head (samples tokens); False for a classifier, which serves
    # pooling requests only (the loader and the worker's start-up read it)
    generates_tokens = True

    def __init__(self, config: ModelConfig, layer_config: LayerConfig) -> None:
        super().__init__()
        self.config, self.layer_config = config, layer_config
        self.model = self.model_cls(config, layer_config, self.attention_cls, self.build_mlp)
        self.tie_word_embeddings = False  # the loader reads it
        self.lm_head: LMHead | None = None
        if layer_config.stage.is_last:
            self.build_head(config, layer_config)

    def build_head(self, config: ModelConfig, layer_config: LayerConfig) -> None:
        """The last stage's head: the LM head, tied to the embedding where the config says so
        and one stage holds both."""
        tie = bool(getattr(config, "tie_word_embeddings", False))
        self.tie_word_embeddings = lm_head_is_tied(layer_config.stage, tie)
        tied_to = self.model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, layer_config, tied_to)

    @staticmethod
    def build_mlp(config: ModelConfig, layer_config: LayerConfig, index: int) -> nn.Module:
        """Decoder layer `index`'s feed-forward (a mixture of experts in the MoE models)."""
        return LlamaMLP(config, layer_config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        received: StageActivations | None = None,
    ) -> torch.Tensor | StageActivations:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden], or only
        the rows of metadata.output_rows ([n, hidden], in its order) when it is set. A
        pipeline stage before the last returns its StageActivations instead; one after the
        first starts from the previous stage's (`received`: input_ids are not read)."""
        return self.model(input_ids, positions, metadata, received)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "only the last pipeline stage computes logits"
        return self.lm_head(hidden)

    def greedy(self, logits: torch.Tensor, out: torch.Tensor) -> None:
        """out[r] = the argmax of logits[r] (compute_logits' [M, vocab]), on the device."""
        assert self.lm_head is not None, "only the last pipeline stage computes logits"
        self.lm_head.greedy(logits, out)


class LlamaForSequenceClassification(LlamaForCausalLM):
    """transformers' *ForSequenceClassification: the decoder with a `score` head ([num_labels,
    hidden], no bias) where the LM head was. It serves pooling requests only: the engine pools
    the prompt's final hidden states (its last token's, as transformers does) and `classify`
    turns them into the labels' logits (worker/pooling.py)."""

    generates_tokens = False

    def build_head(self, config: ModelConfig, layer_config: LayerConfig) -> None:
        num_labels = len(class_labels(config.to_dict()))
        self.score = nn.Linear(config.hidden_size, num_labels, bias=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a sequence-classification model has no LM head: it samples nothing")

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, hidden] pooled final hidden states (float32) -> [N, num_labels] float32 logits."""
        return self.score(pooled.to(self.score.weight.dtype)).float()
