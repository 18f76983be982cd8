"""Mixture-of-experts feed-forward layers (Mixtral, Qwen2-MoE, Qwen3-MoE).

A sparse block routes each token to its top-k experts (`Router`: softmax over the router's
logits in float32, the k largest, renormalised to sum to one where the model says so) and sums
their SwiGLU outputs weighted by the routing (`FusedMoE`: every expert's weights in two stacked
tensors, computed by kernels.triton_moe on the Triton path and by kernels.moe_ref elsewhere).
Qwen2-MoE adds a shared expert, a dense MLP scaled per token by sigmoid(shared_expert_gate x).

Tensor parallelism shards every expert's intermediate dim (w13's rows of gate and of up, w2's
columns) so each rank computes a partial sum of every token's output, all-reduced once; the
router is replicated.

Checkpoints hold one tensor per expert and projection (`experts.{e}.gate_proj.weight`, or
Mixtral's `experts.{e}.w1.weight`); the model's `expert_params_mapping` says which stacked
parameter and part each projection name loads into (`expert_target`).
"""

from __future__ import annotations

import re
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import moe_ref
from pagedserve.models.layer_config import LayerConfig
from pagedserve.models.weights import default_weight_loader, divide, new_parameter

# checkpoint projection name -> (stacked parameter, part: 0 gate, 1 up, None down)
ExpertMapping = dict[str, tuple[str, int | None]]
QWEN_EXPERTS: ExpertMapping = {
    "gate_proj": ("w13", 0),
    "up_proj": ("w13", 1),
    "down_proj": ("w2", None),
}
MIXTRAL_EXPERTS: ExpertMapping = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}
_EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


def expert_target(name: str, mapping: ExpertMapping) -> tuple[str, tuple[int, int | None]] | None:
    """A checkpoint tensor of one expert -> (our stacked parameter's name, (expert, part));
    None for any other tensor."""
    match = _EXPERT_TENSOR.match(name)
    if match is None or match.group(3) not in mapping:
        return None
    prefix, expert, projection = match.groups()
    param, part = mapping[projection]
    return f"{prefix}.{param}", (int(expert), part)


def triton_moe_module() -> ModuleType:
    """kernels.triton_moe, imported on first use (by a layer whose config chose Triton)."""
    from pagedserve.kernels import triton_moe

    return triton_moe


class ReplicatedLinear(nn.Module):
    """x W^T with W [out, in] whole on every rank (small: a router, a gate)."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = new_parameter(output_size, input_size, loader=default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Router(ReplicatedLinear):
    """The router: logits = x W^T ([num_experts, hidden]), then the top k (module doc); on the
    Triton path softmax, top k and renormalisation are one kernel (triton_moe.route)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        config: LayerConfig,
    ) -> None:
        super().__init__(hidden_size, num_experts)
        self.top_k, self.renormalize = top_k, renormalize
        self.fused_ops = config.fused_ops

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] float32, expert ids [T, k], int32 or int64)."""
        if self.fused_ops == "triton":
            return triton_moe_module().route(self(x), self.top_k, self.renormalize)
        probs = torch.softmax(self(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


class FusedMoE(nn.Module):
    """Every expert's SwiGLU MLP, stacked: w13 [E, 2 * I/tp, hidden] (this rank's gate rows,
    then its up rows) and w2 [E, hidden, I/tp]; forward sums the routed experts' outputs and
    all-reduces them over the tensor-parallel group."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, config: LayerConfig
    ) -> None:
        super().__init__()
        if config.quantization is not None:
            raise ValueError(
                f"quantization {config.quantization.method!r} is not supported for "
                "mixture-of-experts models"
            )
        self.tp = config.tp
        self.local_size = local = divide(intermediate_size, config.tp.size)
        self.w13 = new_parameter(num_experts, 2 * local, hidden_size, loader=self.weight_loader)
        self.w2 = new_parameter(num_experts, hidden_size, local, loader=self.weight_loader)
        # what a checkpoint must fill: each expert's gate and up, and its down (models/loader)
        self.w13.expected_shards = {(e, part) for e in range(num_experts) for part in (0, 1)}  # type: ignore[attr-defined]
        self.w2.expected_shards = {(e, None) for e in range(num_experts)}  # type: ignore[attr-defined]
        self.fused_ops = config.fused_ops

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int | None]
    ) -> None:
        """One expert's projection, whole ([I, hidden] gate or up, [hidden, I] down), into
        this rank's slice of the stacked parameter."""
        expert, part = shard_id
        local, start = self.local_size, self.tp.rank * self.local_size
        if part is None:  # down: this rank's input columns
            default_weight_loader(param.data[expert], loaded.narrow(1, start, local))
        else:
            target = param.data[expert].narrow(0, part * local, local)
            default_weight_loader(target, loaded.narrow(0, start, local))

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if self.fused_ops == "triton":
            x = x if x.stride(-1) == 1 else x.contiguous()
            y = triton_moe_module().fused_experts(x, self.w13, self.w2, topk_weights, topk_ids)
        else:
            y = moe_ref.fused_experts(x, self.w13, self.w2, topk_weights, topk_ids)
        self.tp.all_reduce(y)
        return y


class SparseMoeBlock(nn.Module):
    """gate (the router) and experts; with `shared_expert` (Qwen2-MoE) its output, scaled by
    sigmoid(shared_expert_gate x), is added."""

    def __init__(
        self,
        hidden_size: int,
        moe: tuple[int, int, int],  # (num_experts, top_k, expert intermediate size)
        renormalize: bool,
        config: LayerConfig,
        shared_expert: nn.Module | None = None,
    ) -> None:
        super().__init__()
        num_experts, top_k, intermediate_size = moe
        self.gate = Router(hidden_size, num_experts, top_k, renormalize, config)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, config)
        self.shared_expert = shared_expert
        self.shared_expert_gate: ReplicatedLinear | None = None
        if shared_expert is not None:
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate.route(x)
        y = self.experts(x, topk_weights, topk_ids)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


def is_moe(model: nn.Module) -> bool:
    """Whether any layer of the model is a mixture of experts."""
    return any(isinstance(module, FusedMoE) for module in model.modules())
