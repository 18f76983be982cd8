"""The FP8 (E4M3) W8A8 linear method (math: kernels.quant_ref).

After loading, a layer holds `qweight` [N, K] float8_e4m3fn and `weight_scale` [N] float32 (per
output channel; an FP8 checkpoint's per-tensor scales, one per fused part, are spread over that
part's channels) and, for static activation scales, one host float (the largest of the parts',
as every part reads the same input). A block-wise checkpoint (`weight_scale_inv` [N / bn,
K / bk]: W = q * s of q's block) is dequantized in float32 and quantized again per output
channel: one more fp8 rounding of each weight (relative error at most 2^-4, as the first),
so that every product below serves it unchanged.

The product, chosen at construction:
  * CUDA (config.cuda_quant_gemv: the kernel is built for this device, and fp8 in
    cuda_quant.ENGINE_SCHEMES: where it measured faster than Triton's in the engine): batches
    of at most cuda_quant.MAX_ROWS rows (decode) whose operands it takes
    (`cuda_quant.fp8_weight_supported`) through the CUDA C++ weight-only GEMV
    (kernels.cuda_quant: W8A16, the fp8 weight read once);
  * Triton path (CUDA): the other batches of at most WQ_GEMV_MAX_ROWS rows (decode) through
    the Triton weight-streaming GEMV on the fp8 weight, the activations kept in bf16/fp16
    (W8A16: the weight read is the cost, and quantizing the activations would add launches);
    larger batches quantize the activations per token (or by the static scale) in one Triton
    launch and multiply on the FP8 tensor cores (torch._scaled_mm, row-wise scales, bf16/fp16
    out).
  * Otherwise (the CPU): the pure-torch W8A8 reference.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import cuda_quant, quant_ref
from pagedserve.kernels.quant_ref import FP8_DTYPE
from pagedserve.models.layer_config import LayerConfig
from pagedserve.models.linear import LinearBase
from pagedserve.models.quantization.config import Fp8Scheme, QuantizationError
from pagedserve.models.weights import VECTOR, ParamLayout, new_parameter, replace_with_buffer

PER_SHARD = ParamLayout(per_shard=True)
PER_CHANNEL = ParamLayout(output_dim=0, input_dim=None)


class Fp8LinearMethod:
    def __init__(self, scheme: Fp8Scheme, config: LayerConfig) -> None:
        self.scheme = scheme
        self.use_triton = config.fused_ops == "triton"
        self.use_cuda_gemv = config.cuda_quant_gemv and cuda_quant.engine_takes("fp8")
        self.dependent_launch = config.dependent_launch
        self.static_input_scale: float | None = None

    def create_weights(self, layer: LinearBase, bias: bool) -> None:
        n, k, loader = layer.output_size, layer.input_size, layer.weight_loader
        dtype = None if self.scheme.source == "float" else FP8_DTYPE  # None: the model's
        layer.weight = new_parameter(n, k, loader=loader, dtype=dtype)
        if self.scheme.source == "per_tensor":
            parts = len(layer.local_output_sizes)
            layer.weight_scale = new_parameter(
                parts, loader=loader, dtype=torch.float32, layout=PER_SHARD
            )
        elif self.scheme.source == "per_channel":
            layer.weight_scale = new_parameter(
                n, 1, loader=loader, dtype=torch.float32, layout=PER_CHANNEL
            )
        elif self.scheme.source == "block":
            layer.weight_scale_inv = self._block_scales(layer)
        if self.scheme.static_input:
            parts = len(layer.local_output_sizes)
            layer.input_scale = new_parameter(
                parts, loader=loader, dtype=torch.float32, layout=PER_SHARD
            )
        layer.bias = new_parameter(n, loader=loader, layout=VECTOR) if bias else None

    def _block_scales(self, layer: LinearBase) -> torch.nn.Parameter:
        """[N / bn, K / bk] float32, sliced by whole blocks: each fused part's rows and this
        rank's shard must be whole blocks."""
        assert self.scheme.block is not None
        bn, bk = self.scheme.block
        span = layer.input_range()
        if any(size % bn for size in layer.local_output_sizes) or (span and span[1] % bk):
            raise QuantizationError(
                f"block-wise FP8 with blocks of {self.scheme.block}: this layer's parts "
                f"{layer.local_output_sizes} x {layer.input_size} inputs (tensor-parallel shard) "
                "are not whole blocks"
            )
        layout = ParamLayout(outputs_per_index=bn, inputs_per_index=bk)
        rows, cols = -(-layer.output_size // bn), -(-layer.input_size // bk)
        return new_parameter(
            rows, cols, loader=layer.weight_loader, dtype=torch.float32, layout=layout
        )

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        if self.scheme.source == "float":
            qweight, scale = quant_ref.quantize_fp8_rows(layer.weight.data)
            scale = scale.squeeze(1)
        elif self.scheme.source == "block":
            assert self.scheme.block is not None
            bn, bk = self.scheme.block
            n, k = layer.weight.shape
            scales = layer.weight_scale_inv.data.repeat_interleave(bn, 0)[:n]
            dequantized = layer.weight.data.float() * scales.repeat_interleave(bk, 1)[:, :k]
            qweight, scale = quant_ref.quantize_fp8_rows(dequantized)
            scale = scale.squeeze(1)
            replace_with_buffer(layer, "weight_scale_inv", None)
        else:
            qweight, scale = layer.weight.data, self._channel_scales(layer)
        replace_with_buffer(layer, "weight", None)
        layer.register_buffer("qweight", qweight.contiguous())
        if hasattr(layer, "weight_scale"):
            delattr(layer, "weight_scale")
        layer.register_buffer("weight_scale", scale.float().contiguous())
        if self.scheme.static_input:
            self.static_input_scale = float(layer.input_scale.data.max())
            replace_with_buffer(layer, "input_scale", None)

    def _channel_scales(self, layer: LinearBase) -> torch.Tensor:
        scale = layer.weight_scale.data
        if self.scheme.source == "per_channel":
            return scale.reshape(-1)
        sizes = torch.tensor(layer.local_output_sizes, device=scale.device)
        return scale.repeat_interleave(sizes)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        qweight, scale = layer.qweight, layer.weight_scale
        if not self.use_triton:
            return quant_ref.fp8_linear(x, qweight, scale, bias, self.static_input_scale)
        if self.use_cuda_gemv and cuda_quant.fp8_weight_supported(x, qweight, scale, bias):
            return cuda_quant.fp8_weight_gemv(
                x, qweight, scale, bias, dependent_launch=self.dependent_launch
            )
        from pagedserve.kernels import triton_quant

        rows = x.numel() // x.shape[-1]
        if rows <= triton_quant.WQ_GEMV_MAX_ROWS:
            # no programmatic dependent launch: a Llama-3.1-8B fp8 decode step on an H200
            # (scripts/results/session20_h200.md) took 2.71-2.73 ms plain, 2.80-2.82 with the
            # GEMV a dependent, 2.85 with only its successor launched early
            return triton_quant.fp8_weight_gemv(x, qweight, scale, bias)
        xq, x_scale = triton_quant.quantize_fp8_rows(x, self.static_input_scale)
        out = torch._scaled_mm(
            xq, qweight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype
        )
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], qweight.shape[0])
