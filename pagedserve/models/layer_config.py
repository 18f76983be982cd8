"""How a model's layers run: decided once at load and passed to them explicitly.

The loader builds one `LayerConfig` from the EngineConfig and the machine (`loader.
build_layer_config`) and hands it to the model's constructor, which passes it to every layer.
Nothing in a layer's forward looks at a tensor's device, a module global or torch.distributed's
state to choose a path; what a layer checks at run time is only whether a kernel takes the
operands' shapes and strides.

  * fused_ops: which implementation of the small per-token ops (RMSNorm with the residual add,
    SiLU-and-mul, the q/k norm + rotary) runs: "triton" (CUDA), "cpu" (the C++ CPU kernels,
    float32, loaded) or "torch" (the pure-torch references of kernels.ops).
  * cuda_quant_gemv: the quantized linear methods run their skinny products (decode) through
    the CUDA C++ weight-only GEMV (kernels.cuda_quant; the loader sets it only where that kernel
    is built and loads), else through Triton's.
  * small_batch_gemm: low-precision products of at most small_batch_gemm_rows rows (1: batch-1
    decode steps only) go through the Triton weight-streaming GEMM (kernels.triton_gemv)
    instead of cuBLAS.
  * dependent_launch: the Triton and CUDA kernels of the decode path launch as programmatic
    dependents (PDL, sm_90+: kernels.triton_ops' docstring, csrc/grid_dependency.h); the
    loader sets it only for the Triton ops on a CUDA device of compute capability 9 or more.
  * attention: the attention backend's functions and cache layout (kernels.attention_backends).
  * tp: this rank's place in the tensor-parallel group and its collectives.
  * stage: the pipeline stage this model is (the layers it builds: models.stages).
  * quantization: the linear layers' quantization scheme (models.quantization), which gives
    each linear layer its linear method; None: float weights.
  * kv_cache_dtype: the paged KV cache's element type (float8_e4m3fn: fp8 with per-tensor
    scales); None: the model's dtype.
  * sliding_window: the layers with a sliding window attend within it (False: over the whole
    context, EngineConfig.disable_sliding_window).
  * max_model_len: the engine's longest context (EngineConfig.max_model_len), which LongRoPE's
    choice of factors follows (models.layers.RotaryEmbedding); None: the model's own limit.
  * mxfp4_experts: a GPT-OSS release's MXFP4 experts (models.quantization.config's
    `Mxfp4Setting`: where they come from, whether the kernels keep them 4-bit); None: the
    experts' weights are as the quantization says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

from pagedserve.kernels.attention_backends import AttentionBackend
from pagedserve.layout import PipelineStage

if TYPE_CHECKING:
    from pagedserve.models.quantization.config import Mxfp4Setting, QuantizationConfig

FusedOps = Literal["triton", "cpu", "torch"]


@dataclass(frozen=True)
class TensorParallel:
    """This rank in a tensor-parallel group of `size` ranks; group None is torch.distributed's
    default group (the workers' only one)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> None:
        """x = the sum of every rank's x, in place (nothing at size 1)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x side by side along the last dim, rank order (x itself at size 1)."""
        if self.size == 1:
            return x
        shards = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(shards, x, group=self.group)
        return torch.cat(shards, dim=-1)


def tensor_parallel_of_process(size: int) -> TensorParallel:
    """This process's rank in the default torch.distributed group, which must have `size`
    ranks (the workers join it before loading; size 1 needs no group)."""
    if size == 1:
        return TensorParallel()
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"tensor_parallel_size={size} needs an initialised process group")
    if dist.get_world_size() != size:
        raise RuntimeError(
            f"the process group has {dist.get_world_size()} ranks, tensor_parallel_size={size}"
        )
    return TensorParallel(rank=dist.get_rank(), size=size)


@dataclass(frozen=True)
class LayerConfig:
    device: torch.device
    dtype: torch.dtype
    attention: AttentionBackend
    fused_ops: FusedOps = "torch"
    small_batch_gemm: bool = False
    small_batch_gemm_rows: int = 1
    cuda_quant_gemv: bool = False
    dependent_launch: bool = False
    tp: TensorParallel = field(default_factory=TensorParallel)
    stage: PipelineStage = field(default_factory=PipelineStage)
    quantization: QuantizationConfig | None = None
    kv_cache_dtype: torch.dtype | None = None
    sliding_window: bool = True
    max_model_len: int | None = None
    mxfp4_experts: Mxfp4Setting | None = None

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's element type."""
        return self.dtype if self.kv_cache_dtype is None else self.kv_cache_dtype
