"""Which quantization the linear layers use: `resolve_quantization` reads EngineConfig's
`quantization` (vLLM's names) and the checkpoint's `quantization_config` once, at load, and
refuses what the engine cannot run with one clear message.

  fp8                 W8A8 FP8 (E4M3): a float checkpoint quantized while loading (per-channel
                      weight scales), or an FP8 checkpoint (vLLM's "fp8": per-tensor weight
                      scales, activation_scheme dynamic / static; or block-wise scales,
                      `weight_block_size` with `weight_scale_inv` as in Qwen's and
                      DeepSeek's FP8 releases, re-quantized per output channel at load);
                      activations per token
  compressed-tensors  llm-compressor checkpoints: "pack-quantized" integer weights (4 / 8 bit,
                      group or channel, symmetric or not, optional act-order g_idx) or
                      "float-quantized" / "naive-quantized" FP8 (tensor or channel scales)
  gptq                GPTQ (AutoGPTQ / GPTQModel layout): 4 / 8 bit, group or channel, sym or
                      asym, desc_act (g_idx), checkpoint_format gptq (zeros stored minus one)
                      or gptq_v2
  awq                 AWQ GEMM layout: 4 bit, group, with zero points
  int8                weight-only INT8 of a float checkpoint, quantized while loading
                      (symmetric, groups of 128 where the input size allows, else per channel)
  mxfp4               GPT-OSS's published checkpoints: the experts' weights as MXFP4 blocks
                      (E2M1 codes, a power-of-two scale per 32), dequantized to the model's
                      dtype at load unless quantization="mxfp4" is asked, which keeps them
                      4-bit (`Mxfp4Setting`; models.gpt_oss); the linear layers stay float,
                      so it resolves to no quantization here

`quantization` unset takes the checkpoint's method; set, it must agree with the checkpoint.
With load_format="dummy" the random float weights are quantized while loading, in the scheme
the config (or the method's default: 4-bit groups of 128) names. The LM head, the embedding and
the mixture-of-experts routers (`gate`, `shared_expert_gate`) stay in the model's dtype; a
checkpoint that leaves other modules unquantized is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from pagedserve.models.layer_config import LayerConfig
    from pagedserve.models.linear import LinearMethod
    from pagedserve.models.model_config import ModelConfig

from pagedserve.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS

_KV_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
DEFAULT_GROUP_SIZE = 128


@dataclass(frozen=True)
class Mxfp4Setting:
    """A GPT-OSS release's MXFP4 experts: read from the checkpoint's blocks and scales
    ("checkpoint") or, with dummy weights, quantized from float ones ("float"); `keep`: the
    expert kernels decode the 4-bit codes (quantization="mxfp4"), else a checkpoint's are
    dequantized to the model's dtype at load (the faster kernels today)."""

    source: Literal["checkpoint", "float"]
    keep: bool


class QuantizationError(ValueError):
    """A quantization setting or checkpoint the engine cannot run."""


@dataclass(frozen=True)
class Fp8Scheme:
    source: Literal["float", "per_tensor", "per_channel", "block"]  # the checkpoint's weights
    static_input: bool = False  # static per-tensor activation scales (input_scale)
    block: tuple[int, int] | None = None  # "block": the scales' [output, input] block size


@dataclass(frozen=True)
class IntScheme:
    bits: int
    group_size: int  # -1: one group per output channel
    symmetric: bool
    source: Literal["float", "gptq", "awq", "compressed-tensors"]  # the checkpoint's layout
    act_order: bool = False  # g_idx in the checkpoint orders the input channels' groups
    zero_offset: int = 0  # added to stored zero points (GPTQ v1 stores zero - 1)


@dataclass(frozen=True)
class QuantizationConfig:
    method: str  # vLLM's name
    scheme: Fp8Scheme | IntScheme

    def linear_method(self, config: LayerConfig) -> LinearMethod:
        if isinstance(self.scheme, Fp8Scheme):
            from pagedserve.models.quantization.fp8 import Fp8LinearMethod

            return Fp8LinearMethod(self.scheme, config)
        from pagedserve.models.quantization.int_weight import IntWeightLinearMethod

        return IntWeightLinearMethod(self.scheme, config)

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        """Checkpoint tensors that carry nothing the engine needs (compressed-tensors'
        weight_shape: the layer knows its shape)."""
        return self.method == "compressed-tensors" and name.endswith(".weight_shape")


def resolve_kv_cache_dtype(name: str) -> torch.dtype | None:
    """The KV cache's element type for EngineConfig.kv_cache_dtype; None: the model's."""
    if name not in KV_CACHE_DTYPES:
        raise QuantizationError(f"kv_cache_dtype {name!r}: expected one of {KV_CACHE_DTYPES}")
    return _KV_DTYPES[name]


def resolve_quantization(
    requested: str | None, load_format: str, hf_config: ModelConfig
) -> QuantizationConfig | None:
    """The linear layers' quantization for this engine config and checkpoint (see the module
    doc); QuantizationError for anything the engine cannot run."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise QuantizationError(
            f"quantization {requested!r}: expected one of {QUANTIZATION_METHODS}"
        )
    stored: dict[str, Any] | None = getattr(hf_config, "quantization_config", None)
    saved = _checkpoint_method(stored)
    if saved is not None and requested not in (None, saved):
        raise QuantizationError(
            f"the checkpoint is {saved}-quantized: quantization={requested!r} does not apply "
            f"(leave it unset, or pass {saved!r})"
        )
    method = requested or saved
    if method == "mxfp4":
        return _mxfp4_checked(saved, hf_config)
    if method is None:
        return None
    dummy = load_format == "dummy"
    if saved is None and method in ("gptq", "awq", "compressed-tensors") and not dummy:
        raise QuantizationError(
            f"quantization={method!r} needs a checkpoint with a {method} quantization_config"
        )
    scheme = _scheme(method, stored or {})
    if dummy:  # random float weights: quantized while loading, in the scheme's format
        scheme = _from_float(scheme)
    return QuantizationConfig(method, scheme)


def _checkpoint_method(stored: dict[str, Any] | None) -> str | None:
    if stored is None:
        return None
    method = str(stored.get("quant_method", "")).lower()
    if method not in ("fp8", "gptq", "awq", "compressed-tensors", "mxfp4"):
        raise QuantizationError(
            f"the checkpoint's quant_method {method!r} is not supported "
            "(fp8, gptq, awq, compressed-tensors, mxfp4)"
        )
    return method


def _mxfp4_checked(saved: str | None, hf_config: ModelConfig) -> None:
    """MXFP4 is a GPT-OSS checkpoint's experts' format, read into float (the module doc):
    no quantization of the linear layers."""
    if saved != "mxfp4":
        raise QuantizationError("quantization='mxfp4' needs a checkpoint with MXFP4 experts")
    if getattr(hf_config, "model_type", None) != "gpt_oss":
        raise QuantizationError("MXFP4 checkpoints are supported for GPT-OSS only")
    return None


def mxfp4_setting(
    hf_config: ModelConfig, load_format: str, requested: str | None
) -> Mxfp4Setting | None:
    """The experts' MXFP4 setting for a GPT-OSS release's config (None for any other): its
    blocks and scales, or dummy float weights quantized only where quantization="mxfp4"
    asks to keep 4-bit experts."""
    stored = getattr(hf_config, "quantization_config", None) or {}
    if str(stored.get("quant_method", "")).lower() != "mxfp4":
        return None
    keep = requested == "mxfp4"
    if load_format == "dummy":
        return Mxfp4Setting("float", keep) if keep else None
    return Mxfp4Setting("checkpoint", keep)


def _from_float(scheme: Fp8Scheme | IntScheme) -> Fp8Scheme | IntScheme:
    if isinstance(scheme, Fp8Scheme):
        return Fp8Scheme("float")
    return IntScheme(scheme.bits, scheme.group_size, scheme.symmetric, "float")


def _scheme(method: str, stored: dict[str, Any]) -> Fp8Scheme | IntScheme:
    if method == "int8":
        return IntScheme(8, DEFAULT_GROUP_SIZE, True, "float")
    if method == "fp8":
        return _fp8_scheme(stored)
    if method == "gptq":
        return _gptq_scheme(stored)
    if method == "awq":
        return _awq_scheme(stored)
    return _compressed_tensors_scheme(stored)


def _never_quantized(name: str) -> bool:
    """A module name (or compressed-tensors' "re:" pattern) of a module the engine keeps in the
    model's dtype whatever the scheme: the LM head, the embedding, a mixture-of-experts router
    (`mlp.gate`, Mixtral's `block_sparse_moe.gate`) or Qwen2-MoE's shared_expert_gate."""
    if "lm_head" in name or "embed_tokens" in name:
        return True
    words = re.findall(r"\w+", name.removeprefix("re:"))  # the last: the module's own name
    return bool(words) and words[-1] in ("gate", "shared_expert_gate")


def _refuse_ignored_modules(names: list[str] | None, key: str) -> None:
    """Modules left unquantized: only those the engine never quantizes are accepted."""
    others = [n for n in names or [] if not _never_quantized(n)]
    if others:
        raise QuantizationError(
            f"{key} lists modules other than the LM head and the MoE routers ({others[:3]}): "
            "per-module exceptions are not supported"
        )


def _fp8_scheme(stored: dict[str, Any]) -> Fp8Scheme:
    if not stored:
        return Fp8Scheme("float")
    _refuse_ignored_modules(stored.get("ignored_layers"), "ignored_layers")
    _refuse_ignored_modules(stored.get("modules_to_not_convert"), "modules_to_not_convert")
    activation = stored.get("activation_scheme", "dynamic")
    if activation not in ("dynamic", "static"):
        raise QuantizationError(f"activation_scheme {activation!r}: dynamic or static")
    block = stored.get("weight_block_size")
    if block is None:
        return Fp8Scheme("per_tensor", static_input=activation == "static")
    if activation != "dynamic" or len(block) != 2 or not all(int(b) >= 1 for b in block):
        raise QuantizationError(
            f"block-wise FP8 (weight_block_size {block}) needs two block sizes and dynamic "
            "activations"
        )
    return Fp8Scheme("block", block=(int(block[0]), int(block[1])))


def _bits(stored: dict[str, Any], allowed: tuple[int, ...], method: str) -> int:
    bits = int(stored.get("bits", stored.get("w_bit", 4)))
    if bits not in allowed:
        raise QuantizationError(f"{method} with {bits}-bit weights is not supported {allowed}")
    return bits


def _gptq_scheme(stored: dict[str, Any]) -> IntScheme:
    bits = _bits(stored, (4, 8), "gptq")
    if stored.get("lm_head"):
        raise QuantizationError("GPTQ checkpoints with a quantized LM head are not supported")
    if stored.get("dynamic"):
        raise QuantizationError("GPTQ per-module overrides (dynamic) are not supported")
    fmt = stored.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantizationError(f"GPTQ checkpoint_format {fmt!r}: gptq or gptq_v2")
    return IntScheme(
        bits=bits,
        group_size=int(stored.get("group_size", DEFAULT_GROUP_SIZE)),
        symmetric=bool(stored.get("sym", True)),
        source="gptq",
        act_order=bool(stored.get("desc_act", False)),
        zero_offset=1 if fmt == "gptq" else 0,
    )


def _awq_scheme(stored: dict[str, Any]) -> IntScheme:
    bits = _bits(stored, (4,), "awq")
    if str(stored.get("version", "gemm")).lower() != "gemm":
        raise QuantizationError(f"AWQ version {stored.get('version')!r}: only gemm is supported")
    if not stored.get("zero_point", True):
        raise QuantizationError("AWQ without zero points is not supported")
    _refuse_ignored_modules(stored.get("modules_to_not_convert"), "modules_to_not_convert")
    group = int(stored.get("group_size", stored.get("q_group_size", DEFAULT_GROUP_SIZE)))
    return IntScheme(bits, group, symmetric=False, source="awq")


def _compressed_tensors_scheme(stored: dict[str, Any]) -> Fp8Scheme | IntScheme:
    groups = list((stored.get("config_groups") or {}).values())
    if len(groups) != 1 or "Linear" not in groups[0].get("targets", []):
        raise QuantizationError("compressed-tensors: one config group targeting Linear expected")
    _refuse_ignored_modules(stored.get("ignore"), "ignore")
    group, fmt = groups[0], groups[0].get("format") or stored.get("format")
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    if fmt == "pack-quantized" and weights.get("type") == "int" and not inputs:
        return _compressed_int_scheme(weights)
    if fmt in ("float-quantized", "naive-quantized") and weights.get("type") == "float":
        return _compressed_fp8_scheme(weights, inputs)
    raise QuantizationError(
        f"compressed-tensors format {fmt!r} with weights {weights} and input activations "
        f"{inputs} is not supported (pack-quantized int weights, or float-quantized FP8)"
    )


def _compressed_int_scheme(weights: dict[str, Any]) -> IntScheme:
    bits = int(weights.get("num_bits", 4))
    strategy = weights.get("strategy")
    if bits not in (4, 8) or strategy not in ("group", "channel"):
        raise QuantizationError(f"compressed-tensors {bits}-bit {strategy} weights: not supported")
    actorder = weights.get("actorder")
    if actorder not in (None, "group", "weight", False):
        raise QuantizationError(f"compressed-tensors actorder {actorder!r} is not supported")
    return IntScheme(
        bits=bits,
        group_size=int(weights["group_size"]) if strategy == "group" else -1,
        symmetric=bool(weights.get("symmetric", True)),
        source="compressed-tensors",
        act_order=actorder == "group",
    )


def _compressed_fp8_scheme(weights: dict[str, Any], inputs: dict[str, Any] | None) -> Fp8Scheme:
    strategy = weights.get("strategy")
    if weights.get("num_bits") != 8 or strategy not in ("tensor", "channel"):
        raise QuantizationError(f"compressed-tensors FP8 weights {weights}: not supported")
    static = bool(inputs) and not inputs.get("dynamic", False)
    if inputs and static and inputs.get("strategy") != "tensor":
        raise QuantizationError(f"compressed-tensors static activations {inputs}: per tensor only")
    return Fp8Scheme("per_tensor" if strategy == "tensor" else "per_channel", static)


def check_supported(quantization: QuantizationConfig | None, device: torch.device,
                    dtype: torch.dtype) -> None:  # fmt: skip
    """Refuse what this machine cannot run: FP8 matmuls on CUDA need compute capability 8.9
    (Ada, Hopper) and fp16 / bf16 activations; the CPU runs every scheme (reference kernels)."""
    if quantization is None or not isinstance(quantization.scheme, Fp8Scheme):
        return
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise QuantizationError(
                f"FP8 weights need compute capability 8.9 or newer (this GPU: {capability})"
            )
        if dtype == torch.float32:
            raise QuantizationError("FP8 weights on CUDA need dtype bfloat16 or float16")
