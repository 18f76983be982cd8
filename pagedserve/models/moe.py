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
Mixtral's `experts.{e}.w1.weight`, and a quantized checkpoint's tensors of it: FP8 scales, or
GPTQ's / AWQ's / compressed-tensors' packed int4 codes, scales and zero points); the model's
`expert_params_mapping` says which stacked parameter and part each projection name loads into
(`expert_target`).

Int4 experts (W4A16: GPTQ, AWQ and compressed-tensors pack-quantized checkpoints, or dummy
weights of such a scheme) are declared in the checkpoint's layout, stacked per expert, and
converted after loading, expert by expert, with the dense layers' converters
(models.quantization.int_weight) into kernels.quant_ref's layout, stacked (moe_ref.Int4Experts).
The router and Qwen2-MoE's shared_expert_gate are always float (checkpoints leave them so).
"""

from __future__ import annotations

import re
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import moe_ref, quant_ref
from pagedserve.kernels.moe_ref import ClampedSwiGLU, ExpertWeight, Int4Experts
from pagedserve.kernels.quant_ref import FP8_DTYPE
from pagedserve.models.layer_config import LayerConfig
from pagedserve.models.quantization import int_weight
from pagedserve.models.quantization.config import Fp8Scheme, IntScheme, QuantizationError
from pagedserve.models.weights import (
    MATRIX,
    VECTOR,
    OutputShard,
    ParamLayout,
    default_weight_loader,
    divide,
    narrow_shard,
    new_parameter,
)

# checkpoint projection name -> (stacked parameter, part: 0 gate, 1 up, None down)
ExpertMapping = dict[str, tuple[str, int | None]]
QWEN_EXPERTS: ExpertMapping = {
    "gate_proj": ("w13", 0),
    "up_proj": ("w13", 1),
    "down_proj": ("w2", None),
}
MIXTRAL_EXPERTS: ExpertMapping = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}
# a checkpoint tensor's kind -> the suffix of our stacked parameter's name (w13, w13_scale_inv)
_KINDS = {
    "weight": "",
    "weight_scale_inv": "_scale_inv",  # FP8
    "weight_scale": "_scale",  # FP8, compressed-tensors int
    "qweight": "_qweight",  # GPTQ, AWQ
    "qzeros": "_qzeros",
    "scales": "_scales",
    "g_idx": "_g_idx",
    "weight_packed": "_packed",  # compressed-tensors int
    "weight_zero_point": "_zero_point",
    "weight_g_idx": "_g_idx",
}
_EXPERT_TENSOR = re.compile(rf"^(.*\.experts)\.(\d+)\.(\w+)\.({'|'.join(_KINDS)})$")


def expert_target(name: str, mapping: ExpertMapping) -> tuple[str, tuple[int, int | None]] | None:
    """A checkpoint tensor of one expert (its weight, or a quantized checkpoint's tensors) ->
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
    """x W^T (+ b) with W [out, in] whole on every rank (small: a router, a gate)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = new_parameter(output_size, input_size, loader=default_weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = new_parameter(output_size, loader=default_weight_loader, layout=VECTOR)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


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
        bias: bool = False,
    ) -> None:
        super().__init__(hidden_size, num_experts, bias)
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


def _expert_scheme(config: LayerConfig) -> Fp8Scheme | IntScheme | None:
    """The experts' quantization (None: float weights): FP8, or int4 without act-order; any
    other is refused."""
    quantization = config.quantization
    if quantization is None:
        return None
    scheme = quantization.scheme
    if isinstance(scheme, IntScheme) and scheme.bits == 4:
        if scheme.act_order:
            raise QuantizationError(
                "act-order int4 experts (GPTQ desc_act, compressed-tensors actorder 'group': "
                "each expert's own order of its input channels) are not supported"
            )
        return scheme
    if isinstance(scheme, Fp8Scheme) and not scheme.static_input and scheme.source != "per_channel":
        return scheme
    raise QuantizationError(
        f"quantization {quantization.method!r} is not supported for the experts "
        "of a mixture-of-experts model (int4 weight-only GPTQ, AWQ or compressed-tensors "
        "checkpoints; fp8 of a float checkpoint, or an FP8 checkpoint with per-tensor or "
        "block-wise scales and dynamic activations, are)"
    )


class FusedMoE(nn.Module):
    """Every expert's SwiGLU MLP, stacked: w13 [E, 2 * I/tp, hidden] (this rank's gate rows,
    then its up rows) and w2 [E, hidden, I/tp]; forward sums the routed experts' outputs and
    all-reduces them over the tensor-parallel group.

    FP8 (quantization "fp8": a float checkpoint quantized at load, or an FP8 checkpoint's
    per-tensor or block-wise scales): after loading w13 and w2 are float8_e4m3fn with one
    float32 scale per output channel (w13_scale [E, 2 * I/tp], w2_scale [E, hidden]), as the
    dense FP8 layers hold theirs; the products are weight-only (W8A16).

    Int4 (module doc): after loading w13 [E, 2 * I/tp, hidden / 8] and w2 [E, hidden, I/tp / 8]
    are int32 words of codes, with w13_scales / w13_zeros [E, 2 * I/tp, hidden / G] and
    w2_scales / w2_zeros [E, hidden, I/tp / G] in the model's dtype (W4A16). Tensor parallelism
    keeps whole groups: I/tp must be a multiple of the group size G.

    clamped: GPT-OSS's activation instead of SwiGLU (kernels.moe_ref); a subclass with expert
    biases returns them from `expert_biases`."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        config: LayerConfig,
        clamped: ClampedSwiGLU | None = None,
    ) -> None:
        super().__init__()
        self.clamped = clamped
        self.scheme = scheme = _expert_scheme(config)
        self.tp = config.tp
        self.dtype = config.dtype
        self.local_size = local = divide(intermediate_size, config.tp.size)
        shapes = {"w13": (2 * local, hidden_size), "w2": (hidden_size, local)}
        self.group_sizes: dict[str, int] = {}  # int4: each weight's input channels a group
        if isinstance(scheme, IntScheme):
            self._int4_params(num_experts, shapes, scheme, intermediate_size)
        else:
            self._fp8_or_float_params(num_experts, shapes, scheme)
        self.fused_ops = config.fused_ops

    def _fp8_or_float_params(
        self, num_experts: int, shapes: dict[str, tuple[int, int]], scheme: Fp8Scheme | None
    ) -> None:
        dtype = FP8_DTYPE if scheme is not None and scheme.source != "float" else None
        for name, (rows, cols) in shapes.items():
            self._stacked(name, (num_experts, rows, cols), dtype, MATRIX)
        local = self.local_size
        if scheme is not None and scheme.block is not None:
            bn, bk = scheme.block
            if local % bn or local % bk:
                raise QuantizationError(
                    f"block-wise FP8 with blocks of {scheme.block}: the experts' intermediate "
                    f"size per rank ({local}) is not whole blocks"
                )
            for name, (rows, cols) in shapes.items():
                blocks = (num_experts, -(-rows // bn), -(-cols // bk))
                layout = ParamLayout(outputs_per_index=bn, inputs_per_index=bk)
                self._stacked(f"{name}_scale_inv", blocks, torch.float32, layout)
        elif scheme is not None and scheme.source == "per_tensor":
            per_part = ParamLayout(per_shard=True)
            self._stacked("w13_scale", (num_experts, 2), torch.float32, per_part)
            self._stacked("w2_scale", (num_experts, 1), torch.float32, per_part)

    def _int4_params(
        self,
        num_experts: int,
        shapes: dict[str, tuple[int, int]],
        scheme: IntScheme,
        intermediate_size: int,
    ) -> None:
        """The checkpoint's tensors of every expert's projections (int_weight.param_specs),
        stacked; w2's groups along this rank's I/tp inputs must be whole."""
        local, group = self.local_size, scheme.group_size
        if scheme.source != "float" and group > 0 and local % group:
            raise QuantizationError(
                f"int4 experts in groups of {group} inputs: the experts' intermediate size per "
                f"rank ({intermediate_size} / {self.tp.size} = {local}) is not whole groups "
                "(choose a tensor-parallel size that keeps them whole)"
            )
        per_channel = group <= 0
        for name, (rows, cols) in shapes.items():
            self.group_sizes[name] = group_size = int_weight.group_size_for(scheme, cols)
            # w2's inputs are split by rank: its groups too, unless one group spans them all
            groups_sliced = name == "w13" or not per_channel
            weight = int_weight.WeightShapes(rows, cols, scheme.bits, group_size, groups_sliced)
            for kind, (shape, dtype, layout) in int_weight.param_specs(scheme, weight).items():
                optional = int_weight.is_optional(kind, scheme)
                self._stacked(name + _KINDS[kind], (num_experts, *shape), dtype, layout, optional)

    def _stacked(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype | None,
        layout: ParamLayout,
        optional: bool = False,
    ) -> None:
        """A stacked parameter filled expert by expert; `layout`: one expert's tensor's
        (models.weights; per_shard: one value per part, a per-tensor scale). optional: a
        checkpoint may leave it out (zeros)."""
        param = new_parameter(
            *shape, loader=self.weight_loader, dtype=dtype, layout=layout, optional=optional
        )
        # what a checkpoint must fill: each expert's gate and up, or its down (models/loader)
        parts = (0, 1) if name.startswith("w13") else (None,)
        param.expected_shards = set() if optional else {  # type: ignore[attr-defined]
            (e, part) for e in range(shape[0]) for part in parts
        }  # fmt: skip
        if optional:
            param.data.zero_()
        self.register_parameter(name, param)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int | None]
    ) -> None:
        """One expert's tensor of one projection, whole (a weight, [I, hidden] gate or up or
        [hidden, I] down, or its scales, codes or zero points: the parameter's layout says
        which dims index its output and input channels), into this rank's slice of the
        stacked parameter: the rank's rows of gate or up, its input columns of down."""
        expert, part = shard_id
        local, start = self.local_size, self.tp.rank * self.local_size
        if part is None:
            output, inputs = None, (start, local)
        else:
            output, inputs = OutputShard(part * local, start, local, part), None
        layout: ParamLayout = param.shard_layout  # type: ignore[attr-defined]
        target, source = narrow_shard(param.data[expert], loaded, layout, output, inputs)
        default_weight_loader(target, source)

    def process_weights_after_loading(self) -> None:
        """FP8: the weights as fp8 with one scale per output channel; int4: the engine's
        layout (class doc)."""
        if isinstance(self.scheme, IntScheme):
            for name in ("w13", "w2"):
                self._convert_int4(name, self.scheme)
        elif self.scheme is not None:
            for name in ("w13", "w2"):
                self._convert_fp8(name, self.scheme)

    def _convert_fp8(self, name: str, scheme: Fp8Scheme) -> None:
        weight = getattr(self, name).data
        if scheme.source == "per_tensor":
            scale = getattr(self, f"{name}_scale").data
            scale = scale.repeat_interleave(weight.shape[1] // scale.shape[1], dim=1)
            qweight = weight
        else:
            qweight, scale = self._quantized(name, weight, scheme.block)
        for suffix in ("", "_scale", "_scale_inv"):
            if hasattr(self, name + suffix):
                delattr(self, name + suffix)
        self.register_buffer(name, qweight.contiguous())
        self.register_buffer(f"{name}_scale", scale.float().contiguous())

    def _convert_int4(self, name: str, scheme: IntScheme) -> None:
        """The checkpoint's stacked tensors of `name`, expert by expert through the dense
        layers' converter (int_weight.int_weight_of), stacked again in the engine's layout."""
        kinds = [kind for kind in int_weight.SOURCE_PARAMS[scheme.source]
                 if hasattr(self, name + _KINDS[kind])]  # fmt: skip
        stacked = {kind: getattr(self, name + _KINDS[kind]).data for kind in kinds}
        group_size, experts = self.group_sizes[name], []
        for expert in range(next(iter(stacked.values())).shape[0]):
            params = {kind: tensor[expert] for kind, tensor in stacked.items()}
            experts.append(int_weight.int_weight_of(params, scheme, group_size, self.dtype))
        for kind in kinds:
            delattr(self, name + _KINDS[kind])
        self.register_buffer(name, torch.stack([w.qweight for w in experts]))
        self.register_buffer(f"{name}_scales", torch.stack([w.scales for w in experts]))
        self.register_buffer(f"{name}_zeros", torch.stack([w.zeros for w in experts]))

    def _quantized(
        self, name: str, weight: torch.Tensor, block: tuple[int, int] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A float weight, or a block-wise checkpoint's dequantized, quantized per output
        channel, expert by expert: (fp8 [E, rows, cols], scales [E, rows])."""
        qweight = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
        scales = torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)
        for expert in range(weight.shape[0]):
            w = weight[expert].float()
            if block is not None:
                by_block = getattr(self, f"{name}_scale_inv").data[expert]
                by_row = by_block.repeat_interleave(block[0], 0)[: w.shape[0]]
                w = w * by_row.repeat_interleave(block[1], 1)[:, : w.shape[1]]
            q, scale = quant_ref.quantize_fp8_rows(w)
            qweight[expert], scales[expert] = q, scale.squeeze(1)
        return qweight, scales

    def _weights(
        self,
    ) -> tuple[ExpertWeight, ExpertWeight, tuple[torch.Tensor, torch.Tensor] | None]:
        """(w13, w2, fp8 scales) as the expert kernels take them."""
        if isinstance(self.scheme, IntScheme):
            w13, w2 = (
                Int4Experts(getattr(self, name), getattr(self, f"{name}_scales"),
                            getattr(self, f"{name}_zeros"), self.group_sizes[name])
                for name in ("w13", "w2")
            )  # fmt: skip
            return w13, w2, None
        scales = None if self.scheme is None else (self.w13_scale, self.w2_scale)
        return self.w13, self.w2, scales

    def expert_biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(b13 [E, 2 * I/tp], b2 [E, hidden]) added to the experts' products (None: none);
        a rank adds b2 only where the all-reduce counts it once."""
        return None, None

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        w13, w2, scales = self._weights()
        extra = {"biases": self.expert_biases(), "clamped": self.clamped}
        if self.fused_ops == "triton":
            x = x if x.stride(-1) == 1 else x.contiguous()
            fused = triton_moe_module().fused_experts
            y = fused(x, w13, w2, topk_weights, topk_ids, scales=scales, **extra)
        else:
            y = moe_ref.fused_experts(x, w13, w2, topk_weights, topk_ids, scales, **extra)
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
