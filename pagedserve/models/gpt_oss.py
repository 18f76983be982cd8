"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): the Llama decoder with OpenAI's differences.

* attention with biases on q, k, v and o, a learned sink logit per head (it joins each
  softmax's denominator: kernels.attention_ref's doc), and a sliding window of
  `sliding_window` keys on every other layer (`layer_types`); YaRN RoPE;
* a mixture of experts in every layer: the router has a bias and softmaxes the top k logits
  (the renormalised top k of the softmax), and each expert adds biases to both products and
  clamps its SwiGLU (kernels.moe_ref.ClampedSwiGLU).

Checkpoints stack each layer's experts in one tensor a projection, as transformers holds them:
`experts.gate_up_proj` [E, hidden, 2I] with gate and up interleaved along 2I (gate at the even
columns), `experts.down_proj` [E, I, hidden], and their biases [E, 2I] and [E, hidden]. OpenAI's
releases store the two weights in MXFP4 instead (`quantization_config.quant_method` "mxfp4"):
`*_blocks` [E, out, in / 32, 16] uint8 (two E2M1 codes a byte, the low nibble first) and
`*_scales` [E, out, in / 32] uint8 (a power of two, 2^(s - 127), for each 32 codes:
kernels.quant_ref's MXFP4), dequantized to the model's dtype after loading; with
quantization="mxfp4" they stay 4-bit and the expert kernels decode them (gpt-oss-120b's
experts take ~61 GB instead of ~230 GB in bf16, but the decoding Triton GEMM is far slower
today: scripts/results/session31.md). Tensor parallelism gives each rank the same slice of
every expert's intermediate dim as models.moe does; where a rank's slice would cut w2's groups
of 32 inputs, that rank dequantizes its experts even when asked to keep them.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.moe_ref import ClampedSwiGLU, ExpertWeight, Mxfp4Experts
from pagedserve.kernels.quant_ref import MXFP4_BLOCK, dequantize_mxfp4, quantize_mxfp4
from pagedserve.models.layer_config import LayerConfig
from pagedserve.models.llama import LlamaAttention, LlamaForCausalLM
from pagedserve.models.model_config import ModelConfig, num_experts
from pagedserve.models.moe import FusedMoE, Router
from pagedserve.models.weights import default_weight_loader, new_parameter


class GptOssAttention(LlamaAttention):
    """Llama's attention with a sink logit per head (the checkpoint's `self_attn.sinks`)."""

    def attention_options(self, config: ModelConfig) -> dict[str, float | bool]:
        return {"sinks": True}


class GptOssExperts(FusedMoE):
    """FusedMoE with biases and the clamped SwiGLU, loading the checkpoint's stacked tensors
    (module doc): w13 [E, 2 * I/tp, hidden] (this rank's gate rows, then its up rows), w2
    [E, hidden, I/tp], w13_bias [E, 2 * I/tp], w2_bias [E, hidden]; with MXFP4 experts the
    checkpoint's blocks and scales, whole, until `process_weights_after_loading`."""

    def __init__(self, config: ModelConfig, layer_config: LayerConfig) -> None:
        experts, hidden, inter = num_experts(config), config.hidden_size, config.intermediate_size
        clamped = ClampedSwiGLU(float(config.swiglu_alpha), float(config.swiglu_limit))
        super().__init__(experts, hidden, inter, layer_config, clamped)
        self.mxfp4 = layer_config.mxfp4_experts
        if self.mxfp4 is not None and self.mxfp4.source == "checkpoint":
            del self.w13, self.w2
            for name, (rows, cols) in {"w13": (2 * inter, hidden), "w2": (hidden, inter)}.items():
                groups = cols // MXFP4_BLOCK
                self._whole(
                    f"{name}_blocks", (experts, rows, groups, MXFP4_BLOCK // 2), torch.uint8
                )
                self._whole(f"{name}_scales", (experts, rows, groups), torch.uint8)
        else:
            self.w13.weight_loader = self.load_w13  # type: ignore[attr-defined]
            self.w2.weight_loader = self.load_w2  # type: ignore[attr-defined]
            for param in (self.w13, self.w2):
                param.expected_shards = set()  # type: ignore[attr-defined]
        self.w13_bias = new_parameter(experts, 2 * self.local_size, loader=self.load_w13_bias)
        self.w2_bias = new_parameter(experts, hidden, loader=default_weight_loader)

    def _whole(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.register_parameter(name, new_parameter(*shape, loader=default_weight_loader,
                                                    dtype=dtype))  # fmt: skip

    def _rank_rows(self, interleaved: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's gate rows, then its up rows, of a tensor whose `dim` interleaves them
        (gate at the even indices) over the whole intermediate size."""
        start, local = self.tp.rank * self.local_size, self.local_size
        rows = interleaved.narrow(dim, 2 * start, 2 * local)
        gate = torch.arange(0, 2 * local, 2, device=rows.device)
        return torch.cat([rows.index_select(dim, gate), rows.index_select(dim, gate + 1)], dim)

    def _rank_columns(self, down: torch.Tensor) -> torch.Tensor:
        """This rank's input columns of w2 [E, hidden, I]."""
        return down.narrow(2, self.tp.rank * self.local_size, self.local_size)

    def load_w13(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """gate_up_proj [E, hidden, 2I] -> this rank's [E, 2 * I/tp, hidden]."""
        default_weight_loader(param, self._rank_rows(loaded.transpose(1, 2), 1))

    def load_w13_bias(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, self._rank_rows(loaded, 1))

    def load_w2(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """down_proj [E, I, hidden] -> this rank's [E, hidden, I/tp]."""
        default_weight_loader(param, self._rank_columns(loaded.transpose(1, 2)))

    def process_weights_after_loading(self) -> None:
        """MXFP4 experts: a checkpoint's dequantized to the model's dtype, or, where asked to
        keep them (`Mxfp4Setting.keep`), this rank's part of their 4-bit codes and scales kept
        for the expert kernels to decode (a checkpoint's, or dummy float weights quantized),
        unless that part of w2 would cut its groups of 32 inputs: then dequantized (float
        ones stay float). Then what FusedMoE does."""
        if self.mxfp4 is None:
            return super().process_weights_after_loading()
        keep = self.mxfp4.keep and self.local_size % MXFP4_BLOCK == 0  # whole groups
        if self.mxfp4.source == "checkpoint":
            w13 = [self._rank_rows(t, 1) for t in self._take_mxfp4("w13")]
            codes, scales = self._take_mxfp4("w2")
            if keep:
                start, local = self.tp.rank * self.local_size, self.local_size
                groups = (start // MXFP4_BLOCK, local // MXFP4_BLOCK)
                self._keep_mxfp4("w13", *w13)
                self._keep_mxfp4(
                    "w2", codes.narrow(2, start // 2, local // 2), scales.narrow(2, *groups)
                )
            else:
                self.register_buffer("w13", dequantize_mxfp4(*w13, self.dtype))
                dense = dequantize_mxfp4(codes, scales, self.dtype)
                self.register_buffer("w2", self._rank_columns(dense).contiguous())
        elif keep:
            for name in ("w13", "w2"):
                weight = getattr(self, name).data
                delattr(self, name)
                self._keep_mxfp4(name, *quantize_mxfp4(weight))
        return super().process_weights_after_loading()

    def _keep_mxfp4(self, name: str, codes: torch.Tensor, scales: torch.Tensor) -> None:
        self.register_buffer(f"{name}_codes", codes.contiguous())
        self.register_buffer(f"{name}_scales", scales.contiguous())

    def _take_mxfp4(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The checkpoint's MXFP4 weight `name`, whole, as (codes [E, out, in / 2], scales
        [E, out, in / 32]); its parameters dropped."""
        codes = getattr(self, f"{name}_blocks").data.flatten(-2)
        scales = getattr(self, f"{name}_scales").data
        delattr(self, f"{name}_blocks")
        delattr(self, f"{name}_scales")
        return codes, scales

    def _weights(
        self,
    ) -> tuple[ExpertWeight, ExpertWeight, tuple[torch.Tensor, torch.Tensor] | None]:
        if hasattr(self, "w13_codes"):
            w13, w2 = (Mxfp4Experts(getattr(self, f"{name}_codes"), getattr(self, f"{name}_scales"))
                       for name in ("w13", "w2"))  # fmt: skip
            return w13, w2, None
        return super()._weights()

    def expert_biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.w13_bias, self.w2_bias if self.tp.rank == 0 else None


class GptOssMoE(nn.Module):
    """The router (with its bias; the top k renormalised) and the experts."""

    def __init__(self, config: ModelConfig, layer_config: LayerConfig) -> None:
        super().__init__()
        experts, top_k = num_experts(config), config.num_experts_per_tok
        self.router = Router(config.hidden_size, experts, top_k, True, layer_config, bias=True)
        self.experts = GptOssExperts(config, layer_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.router.route(x)
        return self.experts(x, topk_weights, topk_ids)


class GptOssForCausalLM(LlamaForCausalLM):
    attention_cls = GptOssAttention
    # the checkpoint's tensors -> ours: the sinks live in the attention kernel's module, and
    # the stacked experts' tensors (and their biases, blocks and scales) are w13 / w2's
    checkpoint_renames = {
        ".self_attn.sinks": ".self_attn.attn.sinks",
        ".experts.gate_up_proj": ".experts.w13",
        ".experts.down_proj": ".experts.w2",
    }

    @staticmethod
    def build_mlp(config: ModelConfig, layer_config: LayerConfig, index: int) -> nn.Module:
        return GptOssMoE(config, layer_config)
