"""LoRA adapters, several in one step (vLLM's enable_lora and LoRARequest); their files:
lora_format.py.

A worker keeps `max_loras` slots. Each LoRA layer (the attention's and the MLP's projections)
holds, for every slot, A [parts, max_lora_rank, in] and B [out, max_lora_rank] (its fused
parts' rows one after another; ranks zero-padded, the scale s folded into B), sharded as the
layer's own weight is: B by the layer's output shard, A by its input range (a row-parallel
layer adds its partial delta before the all-reduce, which sums it with the rest). Before a
forward the worker groups the step's tokens by slot (`LoRAContext`); a layer then adds each
slot's delta to its tokens: on a GPU by the kernels of kernels/triton_lora.py, else for each
slot in use by a gather, two skinny matmuls and an index_add.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from pagedserve.models.layer_config import LayerConfig
from pagedserve.models.linear import LinearBase
from pagedserve.models.lora_format import TARGETS, WEIGHTS_FILE, AdapterConfig, tensor_name

LAYER_PARTS: dict[str, list[str | int | None]] = {  # our layers' fused parts, in order
    "qkv_proj": ["q", "k", "v"],
    "o_proj": [None],
    "gate_up_proj": [0, 1],
    "down_proj": [None],
}


@dataclass
class LoRAContext:
    """A step's tokens by adapter slot, set by the worker before each forward: either the
    groups (slot, token indices) of the grouped torch path, or, for a step of at most
    len(order) tokens on a GPU (`use_kernel`), the tokens sorted by slot in the device buffers
    that the Triton kernels and the CUDA graphs read (`tokens_by_slot`'s two parts)."""

    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    order: torch.Tensor | None = None  # [rows] int32, device (CUDA only)
    starts: torch.Tensor | None = None  # [slots + 1] int32, device
    use_kernel: bool = False


def tokens_by_slot(slots: np.ndarray, num_slots: int, capacity: int) -> np.ndarray:
    """The kernels' view of a step (triton_lora.py), one int32 array: the tokens that have an
    adapter (`slots[t]` >= 0), sorted by slot and padded to `capacity`, then `num_slots + 1`
    starts (slot s's tokens are order[starts[s] : starts[s + 1]])."""
    with_adapter = np.flatnonzero(slots >= 0)
    by_slot = with_adapter[np.argsort(slots[with_adapter], kind="stable")]
    out = np.zeros(capacity + num_slots + 1, np.int32)
    out[: len(by_slot)] = by_slot
    out[capacity + 1 :] = np.cumsum(np.bincount(slots[with_adapter], minlength=num_slots))
    return out


def kernel_rank(max_lora_rank: int) -> int:
    """The slots' rank: max_lora_rank padded to a power of two of at least 16 (the kernels'
    block), the padding zeros."""
    return max(16, 1 << (max_lora_rank - 1).bit_length())


class LoRALayer:
    """One layer's adapter slots (module doc); `add_delta` is called by the layer's forward."""

    def __init__(
        self,
        layer: LinearBase,
        parts: list[str | int | None],
        shape: tuple[int, int],  # (slots, rank)
        context: LoRAContext,
        config: LayerConfig,
    ) -> None:
        (slots, rank), on = shape, {"dtype": config.dtype, "device": config.device}
        self.layer, self.parts, self.context = layer, parts, context
        self.sizes = layer.local_output_sizes
        self.a = torch.zeros(slots, len(self.sizes), rank, layer.input_size, **on)
        self.b = torch.zeros(slots, sum(self.sizes), rank, **on)

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        order, starts = self.context.order, self.context.starts
        # (a start-up forward larger than the buffer, before any step: no adapter, no groups)
        if self.context.use_kernel and order is not None and x2.shape[0] <= len(order):
            from pagedserve.kernels.triton_lora import add_lora_delta  # GPU only

            assert starts is not None
            x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
            add_lora_delta(x2.to(self.a.dtype), y2, self.a, self.b, order, starts, self.sizes)
            return
        for slot, tokens in self.context.groups:
            xs = x2.index_select(0, tokens).to(self.a.dtype)
            start = 0
            for part, size in enumerate(self.sizes):
                delta = (xs @ self.a[slot, part].T) @ self.b[slot, start : start + size].T
                y2[:, start : start + size].index_add_(0, tokens, delta.to(y2.dtype))
                start += size

    def load(self, slot: int, part: str | int | None, a: torch.Tensor, b: torch.Tensor) -> None:
        """One part's A [r, in] and scaled B [out, r] (whole checkpoint tensors) into `slot`,
        sliced as the layer's weight is."""
        index = self.parts.index(part)
        shard = self.layer.output_shard(part)
        if shard is not None:
            b = b[shard.source_start : shard.source_start + shard.size]
        span = self.layer.input_range()
        if span is not None:
            a = a[:, span[0] : span[0] + span[1]]
        start = sum(self.sizes[:index])
        rank = a.shape[0]
        self.a[slot, index, :rank] = a.to(self.a.device, self.a.dtype)
        self.b[slot, start : start + b.shape[0], :rank] = b.to(self.b.device, self.b.dtype)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()


def attach_lora(
    model: nn.Module, slots: int, rank: int, config: LayerConfig
) -> tuple[dict[tuple[int, str], LoRALayer], LoRAContext]:
    """LoRA slots on every adaptable projection of this rank's decoder layers (the attention's
    and a dense MLP's: not a mixture of experts' shared expert), keyed by (layer index, our
    layer name); the context their forwards read."""
    context = LoRAContext()
    layers: dict[tuple[int, str], LoRALayer] = {}
    for name, module in model.named_modules():
        path = name.split(".")
        in_block = len(path) > 1 and path[-2] in ("self_attn", "mlp") and "layers" in path
        if isinstance(module, LinearBase) and path[-1] in LAYER_PARTS and in_block:
            index = int(path[path.index("layers") + 1])
            lora = LoRALayer(module, LAYER_PARTS[path[-1]], (slots, rank), context, config)
            module.lora = layers[(index, path[-1])] = lora
    return layers, context


def load_adapter(
    layers: dict[tuple[int, str], LoRALayer], slot: int, path: str, adapter: AdapterConfig
) -> None:
    """The adapter's weights into `slot` of this rank's layers (the others' are skipped)."""
    from safetensors import safe_open

    for layer in layers.values():
        layer.clear(slot)
    with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt") as f:
        for (index, ours), layer in layers.items():
            for target in adapter.targets:
                _, module, part = TARGETS[target]
                if module != ours:
                    continue
                a = f.get_tensor(tensor_name(index, target, "A"))
                b = f.get_tensor(tensor_name(index, target, "B")) * adapter.scale
                layer.load(slot, part, a, b)
