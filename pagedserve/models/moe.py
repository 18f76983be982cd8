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

from pagedserve.kernels import moe_ref, quant_ref
from pagedserve.kernels.quant_ref import FP8_DTYPE
from pagedserve.models.layer_config import LayerConfig
from pagedserve.models.quantization.config import Fp8Scheme, QuantizationError
from pagedserve.models.weights import default_weight_loader, divide, new_parameter

# checkpoint projection name -> (stacked parameter, part: 0 gate, 1 up, None down)
ExpertMapping = dict[str, tuple[str, int | None]]
QWEN_EXPERTS: ExpertMapping = {
    "gate_proj": ("w13", 0),
    "up_proj": ("w13", 1),
    "down_proj": ("w2", None),
}
MIXTRAL_EXPERTS: ExpertMapping = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}
_EXPERT_TENSOR = re.compile(
    r"^(.*\.experts)\.(\d+)\.(\w+)\.(weight|weight_scale_inv|weight_scale)$"
)
# a checkpoint tensor's kind -> the suffix of our stacked parameter's name (w13, w13_scale_inv)
_KINDS = {"weight": "", "weight_scale_inv": "_scale_inv", "weight_scale": "_scale"}


def expert_target(name: str, mapping: ExpertMapping) -> tuple[str, tuple[int, int | None]] | None:
    """A checkpoint tensor of one expert (its weight, or an FP8 checkpoint's scales of it) ->
    (our stacked parameter's name, (expert, part)); None for any other tensor."""
    match = _EXPERT_TENSOR.match(name)
    if match is None or match.group(3) not in mapping:
        return None
    prefix, expert, projection, kind = match.groups()
    param, part = mapping[projection]
    return f"{prefix}.{param}{_KINDS[kind]}", (int(expert), part)


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


def _fp8_scheme(config: LayerConfig) -> Fp8Scheme | None:
    """The experts' FP8 scheme (None: float weights); other quantizations are refused."""
    quantization = config.quantization
    if quantization is None:
        return None
    scheme = quantization.scheme
    if not isinstance(scheme, Fp8Scheme) or scheme.static_input or scheme.source == "per_channel":
        raise QuantizationError(
            f"quantization {quantization.method!r} is not supported for the experts "
            "of a mixture-of-experts model (fp8 of a float checkpoint, or an FP8 checkpoint with "
            "per-tensor or block-wise scales and dynamic activations, is)"
        )
    return scheme


class FusedMoE(nn.Module):
    """Every expert's SwiGLU MLP, stacked: w13 [E, 2 * I/tp, hidden] (this rank's gate rows,
    then its up rows) and w2 [E, hidden, I/tp]; forward sums the routed experts' outputs and
    all-reduces them over the tensor-parallel group.

    FP8 (quantization "fp8": a float checkpoint quantized at load, or an FP8 checkpoint's
    per-tensor or block-wise scales): after loading w13 and w2 are float8_e4m3fn with one
    float32 scale per output channel (w13_scale [E, 2 * I/tp], w2_scale [E, hidden]), as the
    dense FP8 layers hold theirs; the products are weight-only (W8A16)."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, config: LayerConfig
    ) -> None:
        super().__init__()
        self.scheme = scheme = _fp8_scheme(config)
        self.tp = config.tp
        self.local_size = local = divide(intermediate_size, config.tp.size)
        dtype = FP8_DTYPE if scheme is not None and scheme.source != "float" else None
        shapes = {"w13": (2 * local, hidden_size), "w2": (hidden_size, local)}
        for name, (rows, cols) in shapes.items():
            self._stacked(name, (num_experts, rows, cols), dtype, (1, 1))
        if scheme is not None and scheme.block is not None:
            bn, bk = scheme.block
            if local % bn or local % bk:
                raise QuantizationError(
                    f"block-wise FP8 with blocks of {scheme.block}: the experts' intermediate "
                    f"size per rank ({local}) is not whole blocks"
                )
            for name, (rows, cols) in shapes.items():
                blocks = (num_experts, -(-rows // bn), -(-cols // bk))
                self._stacked(f"{name}_scale_inv", blocks, torch.float32, (bn, bk))
        elif scheme is not None and scheme.source == "per_tensor":
            self._stacked("w13_scale", (num_experts, 2), torch.float32, None)
            self._stacked("w2_scale", (num_experts, 1), torch.float32, None)
        self.fused_ops = config.fused_ops

    def _stacked(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype | None,
        blocks: tuple[int, int] | None,
    ) -> None:
        """A stacked parameter filled expert by expert (blocks: the output and input channels
        one index covers; None: one value per part, a per-tensor scale)."""
        param = new_parameter(*shape, loader=self.weight_loader, dtype=dtype)
        param.expert_blocks = blocks  # type: ignore[attr-defined]
        # what a checkpoint must fill: each expert's gate and up, or its down (models/loader)
        parts = (0, 1) if name.startswith("w13") else (None,)
        param.expected_shards = {(e, part) for e in range(shape[0]) for part in parts}  # type: ignore[attr-defined]
        self.register_parameter(name, param)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int | None]
    ) -> None:
        """One expert's projection, whole ([I, hidden] gate or up, [hidden, I] down, or its
        scales by blocks of those channels, or its one per-tensor scale), into this rank's
        slice of the stacked parameter."""
        expert, part = shard_id
        blocks: tuple[int, int] | None = param.expert_blocks  # type: ignore[attr-defined]
        if blocks is None:  # a per-tensor scale
            default_weight_loader(param.data[expert, part or 0], loaded.reshape(()))
            return
        rows_per, cols_per = blocks
        local, start = self.local_size, self.tp.rank * self.local_size
        if part is None:  # down: this rank's input columns
            source = loaded.narrow(1, start // cols_per, local // cols_per)
            default_weight_loader(param.data[expert], source)
        else:
            target = param.data[expert].narrow(0, part * local // rows_per, local // rows_per)
            default_weight_loader(target, loaded.narrow(0, start // rows_per, local // rows_per))

    def process_weights_after_loading(self) -> None:
        """FP8: the weights as fp8 with one scale per output channel (class doc)."""
        if self.scheme is None:
            return
        for name in ("w13", "w2"):
            weight = getattr(self, name).data
            if self.scheme.source == "per_tensor":
                scale = getattr(self, f"{name}_scale").data
                scale = scale.repeat_interleave(weight.shape[1] // scale.shape[1], dim=1)
                qweight = weight
            else:
                qweight, scale = self._quantized(name, weight)
            for suffix in ("", "_scale", "_scale_inv"):
                if hasattr(self, name + suffix):
                    delattr(self, name + suffix)
            self.register_buffer(name, qweight.contiguous())
            self.register_buffer(f"{name}_scale", scale.float().contiguous())

    def _quantized(self, name: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A float weight, or a block-wise checkpoint's dequantized, quantized per output
        channel, expert by expert: (fp8 [E, rows, cols], scales [E, rows])."""
        qweight = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
        scales = torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)
        block = self.scheme.block if self.scheme is not None else None
        for expert in range(weight.shape[0]):
            w = weight[expert].float()
            if block is not None:
                by_block = getattr(self, f"{name}_scale_inv").data[expert]
                by_row = by_block.repeat_interleave(block[0], 0)[: w.shape[0]]
                w = w * by_row.repeat_interleave(block[1], 1)[:, : w.shape[1]]
            q, scale = quant_ref.quantize_fp8_rows(w)
            qweight[expert], scales[expert] = q, scale.squeeze(1)
        return qweight, scales

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        scales = None if self.scheme is None else (self.w13_scale, self.w2_scale)
        if self.fused_ops == "triton":
            x = x if x.stride(-1) == 1 else x.contiguous()
            y = triton_moe_module().fused_experts(
                x, self.w13, self.w2, topk_weights, topk_ids, scales=scales
            )
        else:
            y = moe_ref.fused_experts(x, self.w13, self.w2, topk_weights, topk_ids, scales)
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
