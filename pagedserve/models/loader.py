"""Build a model from a Hugging Face config.json and fill its weights.

Weights come from `model.safetensors`, a sharded `model.safetensors.index.json`, or any
`*.safetensors` in the directory; or, with `load_format='dummy'`, from a seeded normal
distribution (benchmarks). HF names map onto the fused parameters through each model's
`packed_modules_mapping` (q/k/v -> qkv_proj, gate/up -> gate_up_proj, or a checkpoint's own
fused tensor -> every part: models.weights.ALL_PARTS); each parameter's `weight_loader` slices
its tensor-parallel shard. How the layers run (kernels, attention backend,
tensor parallelism, quantization, the KV cache's dtype) is decided here, once, in the model's
LayerConfig (`build_layer_config`). After loading, every module that has one runs its
`process_weights_after_loading` (quantized layers convert the checkpoint's form of their
weights to the engine's; a float weight is quantized there).
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import json
import os
from collections.abc import Callable, Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from pagedserve.config import EngineConfig
from pagedserve.kernels import cuda_quant
from pagedserve.kernels.attention_backends import resolve_attention_backend
from pagedserve.kernels.cpu_kernels import load_cpu_kernels
from pagedserve.layout import PipelineStage
from pagedserve.models.layer_config import (
    FusedOps,
    LayerConfig,
    TensorParallel,
    tensor_parallel_of_process,
)
from pagedserve.models.model_config import (
    ModelConfig,
    load_model_config,
    uses_windowed_attention,
)
from pagedserve.models.moe import expert_target
from pagedserve.models.quantization.config import (
    check_supported,
    mxfp4_setting,
    resolve_kv_cache_dtype,
    resolve_quantization,
)
from pagedserve.models.registry import get_model_class
from pagedserve.models.score_head import with_score_head
from pagedserve.models.stages import checkpoint_names
from pagedserve.models.weights import default_weight_loader

DUMMY_WEIGHT_STD = 0.02
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, hf_config: ModelConfig, device: torch.device) -> torch.dtype:
    """'auto': float32 off CUDA; on CUDA bfloat16, unless the checkpoint says float16."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected auto or one of {list(_DTYPES)}")
        return _DTYPES[dtype]
    if device.type != "cuda":
        return torch.float32
    saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return torch.float16 if saved in (torch.float16, "float16") else torch.bfloat16


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _triton_importable() -> bool:
    try:
        importlib.import_module("pagedserve.kernels.triton_ops")
    except ImportError:
        return False
    return True


def _launches_dependents(device: torch.device) -> bool:
    """Programmatic dependent launch exists here: a visible CUDA device of compute capability
    9.0 (Hopper) or more."""
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


def build_layer_config(
    config: EngineConfig,
    hf_config: ModelConfig,
    device: torch.device,
    tp: TensorParallel | None = None,
    stage: PipelineStage | None = None,
) -> LayerConfig:
    """The layers' settings for this engine on this machine: Triton's fused ops on CUDA (when
    triton imports), the C++ CPU kernels for float32 on the CPU (when config.cpu_kernels and
    they load here), else pure torch; the attention backend; the Triton small-batch GEMM for
    CUDA fp16/bf16 (config.small_batch_gemm, up to config.small_batch_gemm_rows rows); the
    CUDA quantized GEMV for quantized weights on CUDA (config.cuda_quant_gemv, where built:
    kernels.cuda_quant.available); programmatic
    dependent launches for those kernels on sm_90+ (config.dependent_launch); this rank's
    tensor-parallel group (tp; None: the process's default group) and pipeline stage (None: the
    whole model); the quantization (models.quantization.config), the KV cache's dtype and the
    engine's context length (config.max_model_len: resolved, or None for the model's)."""
    dtype = resolve_dtype(config.dtype, hf_config, device)
    quantization = resolve_quantization(config.quantization, config.load_format, hf_config)
    check_supported(quantization, device, dtype)
    cpu_kernels = device.type == "cpu" and config.cpu_kernels and load_cpu_kernels()
    fused_ops: FusedOps = "torch"
    if device.type == "cuda" and _triton_importable():
        fused_ops = "triton"
    elif cpu_kernels and dtype == torch.float32:
        fused_ops = "cpu"
    dependent_launch = (
        config.dependent_launch and fused_ops == "triton" and _launches_dependents(device)
    )
    return LayerConfig(
        device=device,
        dtype=dtype,
        attention=resolve_attention_backend(
            config.attention_backend, cpu_kernels, dependent_launch,
            windowed=uses_windowed_attention(hf_config.to_dict(), config.disable_sliding_window),
        ),
        fused_ops=fused_ops,
        dependent_launch=dependent_launch,
        small_batch_gemm=config.small_batch_gemm and fused_ops == "triton"
        and dtype != torch.float32,
        small_batch_gemm_rows=config.small_batch_gemm_rows,
        cuda_quant_gemv=config.cuda_quant_gemv and quantization is not None
        and fused_ops == "triton" and cuda_quant.available(),
        tp=tp if tp is not None else tensor_parallel_of_process(config.tensor_parallel_size),
        stage=stage if stage is not None else PipelineStage(),
        quantization=quantization,
        kv_cache_dtype=resolve_kv_cache_dtype(config.kv_cache_dtype),
        sliding_window=not config.disable_sliding_window,
        max_model_len=config.max_model_len,
        mxfp4_experts=mxfp4_setting(hf_config, config.load_format, config.quantization),
    )  # fmt: skip


def build_model(hf_config: ModelConfig, layer_config: LayerConfig) -> nn.Module:
    """The architecture's model with uninitialised parameters of the config's dtype, on its
    device."""
    model_cls = get_model_class(getattr(hf_config, "architectures", None))
    with default_dtype(layer_config.dtype), torch.device(layer_config.device):
        model = model_cls(hf_config, layer_config)
    return model.eval()


def load_model(
    config: EngineConfig, device: torch.device, layer_config: LayerConfig | None = None
) -> nn.Module:
    """The model with its weights; layer_config None: build_layer_config's."""
    hf_config = load_model_config(config.model_path, config.hf_overrides)
    if layer_config is None:
        layer_config = build_layer_config(config, hf_config, device)
    model = build_model(hf_config, layer_config)
    with torch.no_grad():
        if config.load_format == "dummy":
            init_dummy_weights(model, config.seed)
        else:
            load_weights(model, checkpoint_weights(config, hf_config, layer_config, model))
        for module in model.modules():
            if hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
    return model


def checkpoint_weights(
    config: EngineConfig, hf_config: ModelConfig, layer_config: LayerConfig, model: nn.Module
) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's checkpoint tensors, by the names its parameters have: a classifier has no
    LM head to tie, unless its score head is made from the LM head (`score_head`)."""
    tie = bool(getattr(hf_config, "tie_word_embeddings", False))
    from_lm_head = getattr(hf_config, "method", None) is not None
    rename = checkpoint_names(layer_config.stage, tie and (model.generates_tokens or from_lm_head))
    weights = iterate_safetensors(config.model_path, rename)
    if not from_lm_head:
        return weights
    stage = layer_config.stage
    return with_score_head(
        weights, hf_config, config.tokenizer_path, stage.is_first and stage.is_last
    )


def safetensors_files(model_path: str) -> list[str]:
    index_path = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(model_path, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(model_path, "model.safetensors")
    files = [single] if os.path.exists(single) else sorted(glob.glob(f"{model_path}/*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_path}")
    return files


def iterate_safetensors(
    model_path: str, rename: Callable[[str], str | None] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every checkpoint tensor; with `rename`, (rename(name), tensor), and
    the tensors it maps to None are not read (another pipeline stage's)."""
    for path in safetensors_files(model_path):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                target = name if rename is None else rename(name)
                if target is not None:
                    yield target, f.get_tensor(name)


# an fp8 KV cache's scales as checkpoints name them (vLLM's fp8, compressed-tensors) -> ours
_KV_SCALES = {
    ".self_attn.k_scale": ".self_attn.attn.k_scale",
    ".self_attn.v_scale": ".self_attn.attn.v_scale",
    ".self_attn.k_proj.output_scale": ".self_attn.attn.k_scale",
    ".self_attn.v_proj.output_scale": ".self_attn.attn.v_scale",
}


def _skipped(name: str, model: nn.Module) -> bool:
    """Checkpoint tensors with no parameter on purpose: rotary tables, a tied LM head, what the
    quantization does not read, KV-cache scales without an fp8 KV cache."""
    layer_config: LayerConfig = model.layer_config  # type: ignore[assignment]
    quantization = layer_config.quantization
    return (
        "rotary_emb.inv_freq" in name
        or (getattr(model, "tie_word_embeddings", False) and name == "lm_head.weight")
        or (quantization is not None and quantization.ignores_checkpoint_tensor(name))
        or (layer_config.kv_cache_dtype is None and name.endswith(tuple(_KV_SCALES)))
    )


def _target_name(name: str, model: nn.Module) -> tuple[str, object]:
    """A checkpoint tensor's parameter and the shard id its weight_loader takes (None: none):
    fp8 KV scales, the model's module renames, one expert's projection (stacked per layer:
    models.moe), then the fused projections (`packed_modules_mapping`)."""
    for suffix, ours in _KV_SCALES.items():
        if name.endswith(suffix):
            return name.removesuffix(suffix) + ours, None
    for theirs, ours in getattr(model, "checkpoint_renames", {}).items():
        name = name.replace(theirs, ours)
    expert = expert_target(name, getattr(model, "expert_params_mapping", {}))
    if expert is not None:
        return expert
    mapping: dict[str, tuple[str, str | int]] = getattr(model, "packed_modules_mapping", {})
    for hf_part, (fused_part, shard_id) in mapping.items():
        if f".{hf_part}." in name:
            return name.replace(f".{hf_part}.", f".{fused_part}."), shard_id
    return name, None


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into the model; every parameter must be filled exactly (the
    optional ones may be left out)."""
    params = dict(model.named_parameters())
    loaded: dict[str, set[object]] = {}  # parameter -> the shard ids loaded into it
    for name, tensor in weights:
        if _skipped(name, model):
            continue
        target, shard_id = _target_name(name, model)
        if target not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}")
        param = params[target]
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        if shard_id is None:
            weight_loader(param, tensor)
        else:
            weight_loader(param, tensor, shard_id)
        loaded.setdefault(target, set()).add(shard_id)
    missing = sorted(
        name for name, param in params.items()
        if name not in loaded and not getattr(param, "optional", False)
        or loaded.get(name, set()) < getattr(param, "expected_shards", set())
    )  # fmt: skip
    if missing:
        raise KeyError(f"parameters missing from the checkpoint: {missing}")


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Deterministic random weights: N(0, 0.02) matrices, unit norms, zero biases (optional
    parameters keep their values)."""
    generator: torch.Generator | None = None
    for name, param in model.named_parameters():
        if getattr(param, "optional", False):
            continue
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith(".bias"):
            param.data.zero_()
        else:
            param.data.normal_(0.0, DUMMY_WEIGHT_STD, generator=generator)
