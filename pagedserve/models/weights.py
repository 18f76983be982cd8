"""Parameters filled from a checkpoint: how a parameter's dims map onto its layer's output and
input channels, so that one loader slices any tensor of a layer (a float weight, packed integer
codes, group scales, per-shard fp8 scales) for its tensor-parallel shard and fused part.

A layer loads a checkpoint tensor into a parameter through `load_shard(param, loaded, output,
input)`: `output` says where the tensor's output channels go in this rank's parameter (a fused
layer's part: q, k or v of qkv_proj, gate or up of gate_up_proj) and where they start in the
checkpoint tensor; `input` says which input channels this rank keeps (row-parallel layers).
A checkpoint that stores a fused layer's parts in one tensor (shard id `ALL_PARTS`) is loaded
part by part the same way, each part's `source_start` moved to where its rows begin in that
tensor. `ParamLayout` tells which dim indexes those channels and how many channels one index covers
(8 for 4-bit codes packed along it, the group size for per-group scales). `narrow_shard` does
the slicing alone (the mixture-of-experts layer fills one expert's slice of a stacked parameter
with it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ParamLayout:
    output_dim: int | None = 0  # the dim indexing output channels (None: not along them)
    input_dim: int | None = 1  # the dim indexing input channels (None: not along them)
    outputs_per_index: int = 1  # output channels one index along output_dim covers
    inputs_per_index: int = 1  # input channels one index along input_dim covers
    per_shard: bool = False  # one value per fused part (fp8 per-tensor scales): [num_shards]


MATRIX = ParamLayout()  # a float weight [output channels, input channels]
VECTOR = ParamLayout(output_dim=0, input_dim=None)  # a bias: one value an output channel


@dataclass(frozen=True)
class OutputShard:
    """A loaded tensor's output channels: `size` of them, from `source_start` in the checkpoint
    tensor to `start` in this rank's parameter; `index`: the fused part they are."""

    start: int
    source_start: int
    size: int
    index: int = 0


# the shard id of a checkpoint tensor that holds every part of a fused layer already, stacked
# along the output channels in the layer's order (Phi-3's qkv_proj and gate_up_proj): the
# layer loads each part from its rows as it would from the part's own tensor
ALL_PARTS = "all_parts"


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, loaded {tuple(loaded.shape)}"
        )
    param.data.copy_(loaded)


def new_parameter(
    *shape: int,
    loader: Callable[..., None],
    dtype: torch.dtype | None = None,
    layout: ParamLayout = MATRIX,
    optional: bool = False,
) -> nn.Parameter:
    """An uninitialised frozen parameter (default dtype and device unless given) filled by
    `loader(param, checkpoint_tensor[, shard_id])`; optional: a checkpoint may leave it out
    (it keeps the value it is given here)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.shard_layout = layout  # type: ignore[attr-defined]
    param.optional = optional  # type: ignore[attr-defined]
    return param


def load_shard(
    param: nn.Parameter,
    loaded: torch.Tensor,
    output: OutputShard | None,
    input_range: tuple[int, int] | None,
) -> None:
    """Copy this rank's part of `loaded` into `param` (see the module doc). output None: all
    output channels; input_range (start, size) None: all input channels."""
    layout: ParamLayout = param.shard_layout  # type: ignore[attr-defined]
    target, source = narrow_shard(param.data, loaded, layout, output, input_range)
    if layout.output_dim is None and output is not None:  # one tensor every fused part shares
        parts: set[int] = param.__dict__.setdefault("loaded_parts", set())
        if parts and not torch.equal(target, source.to(target.device, target.dtype)):
            raise ValueError(
                f"the parts of a fused layer disagree on a tensor they share ({tuple(target.shape)}"
                ", per input channel: act-order g_idx?)"
            )
        parts.add(output.index)
    default_weight_loader(target, source)


def narrow_shard(
    target: torch.Tensor,
    loaded: torch.Tensor,
    layout: ParamLayout,
    output: OutputShard | None,
    input_range: tuple[int, int] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the part of `target` that this rank's part of `loaded` fills, that part of `loaded`),
    by `layout` (load_shard's arguments; a per-shard value: target[output.index], loaded as a
    scalar)."""
    if layout.per_shard:
        return target[0 if output is None else output.index], loaded.reshape(())
    source = loaded
    if output is not None and layout.output_dim is not None:
        dim, per = layout.output_dim, layout.outputs_per_index
        target = target.narrow(dim, divide(output.start, per), divide(output.size, per))
        source = source.narrow(dim, divide(output.source_start, per), divide(output.size, per))
    if input_range is not None and layout.input_dim is not None:
        dim, per = layout.input_dim, layout.inputs_per_index
        start, size = input_range
        source = source.narrow(dim, divide(start, per), divide(size, per))
    return target, source


def replace_with_buffer(module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    """Drop the parameter `name` (a checkpoint's form of a weight) and keep `tensor` (the
    engine's form) as a buffer of that name; None drops it only."""
    delattr(module, name)
    if tensor is not None:
        module.register_buffer(name, tensor)
