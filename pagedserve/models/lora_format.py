"""LoRA adapters' files in PEFT's format, read and checked without torch (the tokenizer checks
an adapter before a request is queued; models/lora.py loads it into a worker's slots).

An adapter directory holds adapter_config.json (r, lora_alpha, use_rslora, target_modules) and
adapter_model.safetensors, whose tensors `base_model.model.model.layers.{i}.{self_attn|mlp}.
{q|k|v|o|gate|up|down}_proj.lora_{A|B}.weight` are A [r, in] and B [out, r] of

    y = W x + s B (A x),   s = lora_alpha / r   (lora_alpha / sqrt(r) with use_rslora).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

from pagedserve.models.model_config import ModelConfig, num_experts

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# PEFT's target name -> (the decoder block's submodule, our layer, its fused part)
TARGETS: dict[str, tuple[str, str, str | int | None]] = {
    "q_proj": ("self_attn", "qkv_proj", "q"),
    "k_proj": ("self_attn", "qkv_proj", "k"),
    "v_proj": ("self_attn", "qkv_proj", "v"),
    "o_proj": ("self_attn", "o_proj", None),
    "gate_proj": ("mlp", "gate_up_proj", 0),
    "up_proj": ("mlp", "gate_up_proj", 1),
    "down_proj": ("mlp", "down_proj", None),
}
MAX_HEADER_BYTES = 100 << 20  # a safetensors header larger than this is not an adapter's


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scale: float  # s of the module doc
    targets: tuple[str, ...]


def read_adapter_config(path: str) -> AdapterConfig:
    """adapter_config.json, checked: a LoRA of the projections this engine adapts."""
    try:
        with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"no readable LoRA adapter at {path!r} ({exc})") from None
    if not isinstance(raw, dict) or raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path!r} is not a LoRA adapter")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise ValueError(f"the adapter at {path!r} has no valid r / lora_alpha")
    targets = raw.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"the adapter at {path!r} has no list of target_modules")
    unknown = sorted(set(targets) - set(TARGETS))
    if not targets or unknown:
        raise ValueError(f"LoRA target modules must be among {sorted(TARGETS)}, got {unknown}")
    if raw.get("modules_to_save") or raw.get("bias", "none") != "none":
        raise ValueError("LoRA adapters with modules_to_save or biases are not supported")
    scale = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    return AdapterConfig(rank, float(scale), tuple(sorted(set(targets))))


def tensor_name(layer: int, target: str, which: str) -> str:
    block = TARGETS[target][0]
    return f"base_model.model.model.layers.{layer}.{block}.{target}.lora_{which}.weight"


def expected_shapes(model: ModelConfig, adapter: AdapterConfig) -> dict[str, tuple[int, int]]:
    """Every tensor the adapter must hold, with its shape, for this model."""
    head_dim = getattr(model, "head_dim", None) or model.hidden_size // model.num_attention_heads
    hidden, inter = model.hidden_size, model.intermediate_size
    q, kv = model.num_attention_heads * head_dim, model.num_key_value_heads * head_dim
    features = {  # (in, out)
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
        "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }  # fmt: skip
    shapes = {}
    for layer in range(model.num_hidden_layers):
        for target in adapter.targets:
            d_in, d_out = features[target]
            shapes[tensor_name(layer, target, "A")] = (adapter.rank, d_in)
            shapes[tensor_name(layer, target, "B")] = (d_out, adapter.rank)
    return shapes


def check_adapter(path: str, model: ModelConfig, max_rank: int) -> AdapterConfig:
    """The adapter's config, once its rank fits and its weights file holds every tensor of
    the right shape for this model (from the safetensors header: nothing else is read), so
    that a worker can load it without failing."""
    adapter = read_adapter_config(path)
    feed_forward = sorted(set(adapter.targets) & {"gate_proj", "up_proj", "down_proj"})
    if num_experts(model) and feed_forward:
        raise ValueError(
            f"the adapter at {path!r} targets {feed_forward}: LoRA on a mixture-of-experts "
            "model adapts only the attention projections (q_proj, k_proj, v_proj, o_proj)"
        )
    if adapter.rank > max_rank:
        raise ValueError(f"the adapter's rank {adapter.rank} exceeds max_lora_rank {max_rank}")
    header = _safetensors_header(os.path.join(path, WEIGHTS_FILE))
    for name, shape in expected_shapes(model, adapter).items():
        entry = header.get(name)
        if not isinstance(entry, dict) or entry.get("shape") != list(shape):
            raise ValueError(f"the adapter at {path!r} lacks {name} of shape {list(shape)}")
    return adapter


def _safetensors_header(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > MAX_HEADER_BYTES:
                raise ValueError("header too large")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise ValueError(f"cannot read the adapter weights {path!r} ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"cannot read the adapter weights {path!r}")
    return header


class AdapterChecks:
    """The tokenizer's check of each request's adapter (`check_adapter`), remembered by
    path (at most `capacity` of them)."""

    def __init__(self, model: ModelConfig, enabled: bool, max_rank: int, capacity: int = 256):
        self.model, self.enabled, self.max_rank = model, enabled, max_rank
        self.capacity = capacity
        self.checked: set[str] = set()

    def check(self, lora_int_id: int, path: str) -> None:
        if not self.enabled:
            raise ValueError("LoRA adapters need an engine started with --enable-lora")
        if lora_int_id < 1:
            raise ValueError(f"lora_int_id must be at least 1, got {lora_int_id}")
        if path not in self.checked:
            check_adapter(path, self.model, self.max_rank)
            if len(self.checked) >= self.capacity:
                self.checked.clear()
            self.checked.add(path)
