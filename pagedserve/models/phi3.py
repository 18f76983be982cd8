"""Phi-3 and Phi-4 (`Phi3ForCausalLM`: Phi-3-mini/medium, Phi-3.5-mini, Phi-4, Phi-4-mini): the
Llama decoder as checkpoints store it fused, one `qkv_proj` ([q; k; v] rows) and one
`gate_up_proj` ([gate; up] rows) a layer, loaded part by part into the fused layers (so that
tensor parallelism shards them as it shards separate tensors: models.weights.ALL_PARTS). The
rest is configuration the shared layers read: partial rotary (`partial_rotary_factor`,
Phi-4-mini), LongRoPE (`rope_scaling` "longrope", or "su" in older configs: Phi-3-128k,
Phi-3.5, Phi-4-mini; models.layers), tied embeddings (Phi-4-mini), no biases."""

from __future__ import annotations

from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.weights import ALL_PARTS


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping = {
        "qkv_proj": ("qkv_proj", ALL_PARTS),
        "gate_up_proj": ("gate_up_proj", ALL_PARTS),
    }
