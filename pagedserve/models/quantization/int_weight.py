"""The weight-only integer linear method (W4A16 / W8A16; math and layout: kernels.quant_ref).

The layer's parameters are the checkpoint's (formats.py: GPTQ, AWQ, compressed-tensors) or a
float weight quantized after loading (int8; dummy weights of any integer scheme). After
loading it holds the engine's layout as buffers: `qweight`, `scales`, `zeros` and `perm`
(act-order only, else None). The mixture-of-experts layer (models.moe) declares and converts
its int4 experts with the same functions (`param_specs`, `int_weight_of`), expert by expert.

The product, chosen at construction:
  * CUDA (config.cuda_quant_gemv: the kernel is built for this device, and the scheme in
    cuda_quant.ENGINE_SCHEMES: where it measured faster than Triton's): batches of at most
    cuda_quant.MAX_ROWS rows (decode) whose operands it takes (`cuda_quant.int_weight_supported`:
    bf16 / fp16, groups of a multiple of 128 columns, ...) through the CUDA C++ weight-only GEMV
    (kernels.cuda_quant: the weight read once, in its packed form, on the tensor cores);
  * Triton path (CUDA): the other batches of at most WQ_GEMV_MAX_ROWS rows through the
    dequantize-in-the-GEMV Triton kernel; larger batches dequantize the weight to the
    activations' dtype (one Triton launch) for a cuBLAS matmul.
  * Otherwise (the CPU): the pure-torch reference (dequantize, F.linear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels import cuda_quant, quant_ref
from pagedserve.kernels.quant_ref import IntWeight
from pagedserve.models.layer_config import LayerConfig
from pagedserve.models.linear import LinearBase, RowParallelLinear
from pagedserve.models.quantization import formats
from pagedserve.models.quantization.config import IntScheme, QuantizationError
from pagedserve.models.weights import VECTOR, ParamLayout, new_parameter, replace_with_buffer

# each source's parameters: name -> (shape, dtype, layout) for a layer, made by param_specs
ParamSpecs = dict[str, tuple[tuple[int, ...], torch.dtype | None, ParamLayout]]
SOURCE_PARAMS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx"),
    "float": ("weight",),
}


class IntWeightLinearMethod:
    def __init__(self, scheme: IntScheme, config: LayerConfig) -> None:
        self.scheme = scheme
        self.use_triton = config.fused_ops == "triton"
        self.use_cuda_gemv = config.cuda_quant_gemv and cuda_quant.engine_takes(f"int{scheme.bits}")
        self.dtype = config.dtype
        self.dependent_launch = config.dependent_launch
        self.group_size = 0  # per layer, set by create_weights

    def create_weights(self, layer: LinearBase, bias: bool) -> None:
        self.group_size = self._layer_group_size(layer)
        for name, (shape, dtype, layout) in self._param_specs(layer).items():
            optional = is_optional(name, self.scheme)
            param = new_parameter(
                *shape, loader=layer.weight_loader, dtype=dtype, layout=layout, optional=optional
            )
            if optional:
                param.data.zero_()
            layer.register_parameter(name, param)
        layer.bias = new_parameter(layer.output_size, loader=layer.weight_loader, layout=VECTOR) \
            if bias else None  # fmt: skip

    def _layer_group_size(self, layer: LinearBase) -> int:
        group = group_size_for(self.scheme, layer.input_size)
        if self.scheme.act_order and isinstance(layer, RowParallelLinear) and layer.tp.size > 1:
            raise QuantizationError("act-order (g_idx) with tensor parallelism is not supported")
        return group

    def _param_specs(self, layer: LinearBase) -> ParamSpecs:
        """The checkpoint's parameters of this layer (none but a float weight for "float")."""
        # the dim of group scales / zeros along K is sliced by a row-parallel layer's rank,
        # unless the scheme is per channel (the checkpoint holds one group for all of K)
        per_channel = self.scheme.group_size <= 0
        groups_sliced = not (per_channel and isinstance(layer, RowParallelLinear))
        shapes = WeightShapes(layer.output_size, layer.input_size, self.scheme.bits,
                              self.group_size, groups_sliced)  # fmt: skip
        return param_specs(self.scheme, shapes)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        params = {name: getattr(layer, name).data for name in SOURCE_PARAMS[self.scheme.source]
                  if hasattr(layer, name)}  # fmt: skip
        weight = int_weight_of(params, self.scheme, self.group_size, self.dtype)
        for name in params:
            replace_with_buffer(layer, name, None)
        layer.register_buffer("qweight", weight.qweight)
        layer.register_buffer("scales", weight.scales)
        layer.register_buffer("zeros", weight.zeros)
        layer.register_buffer("perm", weight.perm)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = IntWeight(layer.qweight, layer.scales, layer.zeros, self.scheme.bits,
                           self.group_size, layer.perm)  # fmt: skip
        if not self.use_triton:
            return quant_ref.int_linear(x, weight, bias)
        if self.use_cuda_gemv and cuda_quant.int_weight_supported(x, weight, bias):
            return cuda_quant.int_weight_gemv(
                x, weight, bias, dependent_launch=self.dependent_launch
            )
        from pagedserve.kernels import triton_quant

        if x.numel() <= triton_quant.WQ_GEMV_MAX_ROWS * x.shape[-1]:
            return triton_quant.int_weight_gemv(
                x, weight, bias, dependent_launch=self.dependent_launch
            )
        if weight.perm is not None:
            x = x.index_select(-1, weight.perm)
        return F.linear(x, triton_quant.dequantize(weight, x.dtype), bias)


def is_optional(name: str, scheme: IntScheme) -> bool:
    """A parameter a checkpoint may leave out: g_idx, unless the scheme is act-order."""
    return name in ("g_idx", "weight_g_idx") and not scheme.act_order


def group_size_for(scheme: IntScheme, k: int) -> int:
    """Input channels a group of a weight of k input channels: the scheme's; per channel for
    -1 (and for a float weight whose input size the scheme's groups do not divide)."""
    group = scheme.group_size
    if group <= 0 or (scheme.source == "float" and k % group):
        return k
    if k % group:
        raise QuantizationError(f"group size {group} does not divide the input size {k}")
    return group


def int_weight_of(
    params: dict[str, torch.Tensor], scheme: IntScheme, group_size: int, dtype: torch.dtype
) -> IntWeight:
    """One weight's checkpoint tensors (SOURCE_PARAMS' names; a float weight for "float",
    quantized here) -> the engine's IntWeight."""
    if scheme.source == "float":
        weight = params["weight"]
        return quant_ref.quantize_int_weight(weight, scheme.bits, group_size, scheme.symmetric)
    if scheme.source == "gptq":
        return formats.from_gptq(
            params["qweight"], params["qzeros"], params["scales"], params["g_idx"], scheme,
            group_size, dtype,
        )  # fmt: skip
    if scheme.source == "awq":
        return formats.from_awq(
            params["qweight"], params["qzeros"], params["scales"], scheme, group_size, dtype
        )
    return formats.from_compressed_tensors(
        params["weight_packed"], params["weight_scale"], params.get("weight_zero_point"),
        params["weight_g_idx"], scheme, group_size, dtype,
    )  # fmt: skip


class WeightShapes:
    """A weight's sizes as the packed layouts need them: n output and k input channels (this
    rank's), groups of group_size inputs; groups_sliced: the scales' dim along K is sliced by
    a rank that keeps part of the inputs (False: one group for all of K, kept whole)."""

    def __init__(self, n: int, k: int, bits: int, group_size: int, groups_sliced: bool) -> None:
        self.n, self.k, self.group = n, k, group_size
        self.per_word = 32 // bits
        self.groups = self.k // group_size
        self.groups_sliced = groups_sliced


def param_specs(scheme: IntScheme, shapes: WeightShapes) -> ParamSpecs:
    """The checkpoint's parameters of one weight (none but a float weight for "float")."""
    if scheme.source == "float":
        return {"weight": ((shapes.n, shapes.k), None, ParamLayout())}
    if scheme.source == "gptq":
        return _gptq_params(shapes)
    if scheme.source == "awq":
        return _awq_params(shapes)
    return _compressed_tensors_params(shapes, scheme.symmetric)


def _gptq_params(s: WeightShapes) -> ParamSpecs:
    along_k = 0 if s.groups_sliced else None
    i32 = torch.int32
    return {
        "qweight": ((s.k // s.per_word, s.n), i32, ParamLayout(1, 0, 1, s.per_word)),
        "qzeros": (
            (s.groups, s.n // s.per_word),
            i32,
            ParamLayout(1, along_k, s.per_word, s.group),
        ),
        "scales": ((s.groups, s.n), None, ParamLayout(1, along_k, 1, s.group)),
        "g_idx": ((s.k,), i32, ParamLayout(output_dim=None, input_dim=0)),
    }


def _awq_params(s: WeightShapes) -> ParamSpecs:
    along_k = 0 if s.groups_sliced else None
    i32 = torch.int32
    return {
        "qweight": ((s.k, s.n // 8), i32, ParamLayout(1, 0, 8, 1)),
        "qzeros": ((s.groups, s.n // 8), i32, ParamLayout(1, along_k, 8, s.group)),
        "scales": ((s.groups, s.n), None, ParamLayout(1, along_k, 1, s.group)),
    }


def _compressed_tensors_params(s: WeightShapes, symmetric: bool) -> ParamSpecs:
    along_k = 1 if s.groups_sliced else None
    i32 = torch.int32
    specs: ParamSpecs = {
        "weight_packed": ((s.n, s.k // s.per_word), i32, ParamLayout(0, 1, 1, s.per_word)),
        "weight_scale": ((s.n, s.groups), None, ParamLayout(0, along_k, 1, s.group)),
        "weight_g_idx": ((s.k,), i32, ParamLayout(output_dim=None, input_dim=0)),
    }
    if not symmetric:
        zero_layout = ParamLayout(0, along_k, s.per_word, s.group)
        specs["weight_zero_point"] = ((s.n // s.per_word, s.groups), i32, zero_layout)
    return specs
