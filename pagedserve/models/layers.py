"""The shared layer set the models are written against.

Tensor parallelism: every parallel layer reads its rank and size from torch.distributed when a
process group is initialised (else rank 0 of 1), allocates only its shard and carries a
`weight_loader` on each parameter that takes the full Hugging Face tensor and copies its slice.
Column-parallel layers shard the output dim (no communication); row-parallel layers shard the
input dim and all-reduce their output; the vocabulary is sharded by rows (embedding: masked
lookup + all-reduce; LM head: local logits + all-gather).
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, overload

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from pagedserve.kernels.triton_ops import KVWrite

from pagedserve.kernels.attention import (
    ATTENTION_BACKENDS,
    KV_CACHE_WRITERS,
    AttentionMetadata,
    OutputRows,
    cpu_kernels_loaded,
)
from pagedserve.kernels.ops import (
    apply_rotary_full,
    fused_add_rms_norm_fast,
    rms_norm_fast,
    rotary_tables,
    silu_and_mul,
)


def tp_rank_and_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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


def _mkldnn_linear_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(
            torch.ops.mkldnn, "_linear_pointwise"
        )
    except (AttributeError, RuntimeError):
        return False


_MKLDNN_LINEAR = _mkldnn_linear_available()


class PackedWeight:
    """A float32 CPU weight [out, in] reordered once for oneDNN's linear (the layout Inductor
    uses for frozen CPU weights): small-batch matmuls run ~1.3-1.6x faster than through MKL's
    sgemm on the plain weight. Repacked when the weight changes (its version counter)."""

    def __init__(self) -> None:
        self._key: tuple[int, int] | None = None
        self._packed: torch.Tensor | None = None

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if not (
            _MKLDNN_LINEAR
            and x.device.type == "cpu"
            and x.dtype == torch.float32
            and weight.dtype == torch.float32
            and not torch.is_grad_enabled()
        ):
            return F.linear(x, weight, bias)
        key = (weight.data_ptr(), 0 if weight.is_inference() else weight._version)
        if self._key != key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)
            self._key = key
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")


def cpu_fast_path(x: torch.Tensor) -> bool:
    """Whether x goes through the C++ CPU kernels (float32 CPU rows, kernels loaded, no
    autograd): RMSNorm, SiLU-and-mul, rotary and the KV write, fused, in place where noted."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.stride(-1) == 1
        and not torch.is_grad_enabled()
        and cpu_kernels_loaded()
    )


@functools.cache
def triton_ops_module() -> ModuleType | None:
    """pagedserve.kernels.triton_ops, imported on first use; None when triton is missing."""
    try:
        return importlib.import_module("pagedserve.kernels.triton_ops")
    except ImportError:
        return None


_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def use_triton_ops(x: torch.Tensor) -> bool:
    """Whether x goes through the Triton kernels (CUDA tensors of a float dtype they take,
    triton importable): RMSNorm (fused with the residual add), SiLU-and-mul, and the
    attention's q/k norm + rotary, one launch each. Tests patch this to run them interpreted
    on the CPU."""
    return x.is_cuda and x.dtype in _TRITON_DTYPES and triton_ops_module() is not None


def _triton_ops() -> ModuleType:
    module = triton_ops_module()
    if module is None:
        raise RuntimeError("the Triton path was chosen but triton is not importable")
    return module


@functools.cache
def triton_gemv_module() -> ModuleType | None:
    """pagedserve.kernels.triton_gemv, imported on first use; None when triton is missing."""
    try:
        return importlib.import_module("pagedserve.kernels.triton_gemv")
    except ImportError:
        return None


_small_batch_gemm = True
# Rows up to which `linear` prefers the Triton GEMM: on the H200 it beats cuBLAS at 1 row
# (1.46x per Qwen3-0.6B layer, 1.11x per Llama-3.1-8B layer) but not at 4 (0.73x for Llama;
# scripts/results/kernels_h200.md), so only single-row (batch-1 decode) products take it.
SMALL_BATCH_GEMM_MAX_ROWS = 1


def enable_small_batch_gemm(enabled: bool) -> None:
    """Whether `linear` may use the Triton weight-streaming GEMM (EngineConfig's
    small_batch_gemm, set by the model runner for its process)."""
    global _small_batch_gemm
    _small_batch_gemm = enabled


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight
) -> torch.Tensor:
    """x W^T + b for the linear layers and the LM head. CUDA fp16/bf16 batches of at most
    SMALL_BATCH_GEMM_MAX_ROWS rows (batch-1 decode) go through the Triton weight-streaming GEMM
    (triton_gemv.skinny_linear: cuBLAS picks poor tiles for such skinny shapes); everything
    else, fp32 and the CPU included, through `packed` (oneDNN on the CPU, else F.linear)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if (
        _small_batch_gemm
        and rows <= SMALL_BATCH_GEMM_MAX_ROWS
        and use_triton_ops(x)
        and x.dtype != torch.float32
    ):
        gemv = triton_gemv_module()
        if gemv is not None and gemv.skinny_linear_applies(x, weight, bias):
            return gemv.skinny_linear(x, weight, bias)
    return packed.linear(x, weight, bias)


def _new_parameter(*shape: int, loader: Callable[..., None]) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


class LinearBase(nn.Module):
    """y = x W^T + b with W [output_per_rank, input_per_rank]."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.input_size, self.output_size = input_size, output_size
        self.weight = _new_parameter(output_size, input_size, loader=self.weight_loader)
        self.bias = _new_parameter(output_size, loader=self.weight_loader) if bias else None
        self._packed = PackedWeight()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self._packed)


class ReplicatedLinear(LinearBase):
    """The full weight on every rank."""


class ColumnParallelLinear(LinearBase):
    """Shards the output dim: rank r holds rows [r * out/tp, (r + 1) * out/tp)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        _, tp_size = tp_rank_and_size()
        super().__init__(input_size, divide(output_size, tp_size), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_up); shard_id picks the part."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        target = param.data.narrow(0, offset, size)
        default_weight_loader(target, loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, sharded by heads. When tp_size exceeds the number
    of kv heads, each kv head is replicated over tp_size / num_kv_heads ranks."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        _, tp_size = tp_rank_and_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp_size)
        if tp_size >= num_kv_heads:
            self.num_kv_heads, self.kv_replicas = 1, divide(tp_size, num_kv_heads)
        else:
            self.num_kv_heads, self.kv_replicas = divide(num_kv_heads, tp_size), 1
        local_out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, local_out * tp_size, bias)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        if shard_id == "q":
            offset, size, head_start = 0, self.q_size, self.tp_rank * self.num_heads
        else:
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, head_start = self.kv_size, (self.tp_rank // self.kv_replicas) * self.num_kv_heads
        source = loaded.narrow(0, head_start * self.head_dim, size)
        default_weight_loader(param.data.narrow(0, offset, size), source)


class RowParallelLinear(LinearBase):
    """Shards the input dim; the partial outputs are all-reduced (bias added once)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        _, tp_size = tp_rank_and_size()
        super().__init__(divide(input_size, tp_size), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # bias: replicated
            default_weight_loader(param, loaded)
            return
        size = param.shape[1]
        default_weight_loader(param, loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        y = linear(x, self.weight, bias, self._packed)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y


class VocabParallelBase(nn.Module):
    """A [vocab, hidden] weight sharded by vocabulary rows (padded: each rank holds as many)."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: nn.Parameter | None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size()
        self.vocab_size = vocab_size
        self.rows_per_rank = math.ceil(vocab_size / self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        if tied_to is not None:
            self.weight = tied_to
        else:
            self.weight = _new_parameter(self.rows_per_rank, hidden_size, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows = max(0, min(self.rows_per_rank, self.vocab_size - self.vocab_start))
        param.data.zero_()
        default_weight_loader(param.data[:rows], loaded.narrow(0, self.vocab_start, rows))


class VocabEmbedding(VocabParallelBase):
    """Token embedding; under TP a masked local lookup followed by an all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size, tied_to=None)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.rows_per_rank)
        y = F.embedding(local.clamp(0, self.rows_per_rank - 1), self.weight)
        y = y * in_shard.unsqueeze(-1).to(y.dtype)
        dist.all_reduce(y)
        return y


class LMHead(VocabParallelBase):
    """logits = hidden @ W^T over the vocabulary; shares the embedding's weight when tied."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None
    ) -> None:
        tied_weight = tied_to.weight if tied_to is not None else None
        super().__init__(vocab_size, hidden_size, tied_to=tied_weight)
        self._packed = PackedWeight()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, None, self._packed)
        if self.tp_size > 1:
            shards = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(shards, logits)
            logits = torch.cat(shards, dim=-1)
        return logits[..., : self.vocab_size]


class RMSNorm(nn.Module):
    """RMSNorm; with a residual it fuses the add: forward(x, residual) -> (normed, x + residual).
    On the C++ CPU path and on the Triton path (when x and residual are contiguous and the weight
    has x's dtype) the fused form works in place: residual becomes x + residual and x the normed
    values (the decoder layers hand both over and use only the returned tensors)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if use_triton_ops(x) and (
            residual is None or (residual.shape == x.shape and residual.dtype == x.dtype)
        ):
            triton_ops = _triton_ops()
            if residual is None:
                return triton_ops.rms_norm(x, self.weight, self.eps)
            inplace = (
                self.weight.dtype == x.dtype and x.is_contiguous() and residual.is_contiguous()
            )
            return triton_ops.fused_add_rms_norm(x, residual, self.weight, self.eps, inplace)
        if x.dim() == 2 and cpu_fast_path(x) and self.weight.dtype == torch.float32:
            if residual is None:
                out = torch.empty_like(x)
                torch.ops.pagedserve_cpu.rms_norm(out, x, self.weight, self.eps)
                return out
            if residual.stride(-1) == 1 and residual.dtype == torch.float32:
                torch.ops.pagedserve_cpu.fused_add_rms_norm(x, residual, self.weight, self.eps)
                return x, residual
        if residual is None:
            return rms_norm_fast(x, self.weight, self.eps)
        return fused_add_rms_norm_fast(x, residual, self.weight, self.eps)


def rope_inverse_frequencies(
    head_dim: int, rope_theta: float, rope_scaling: dict | None
) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i / head_dim), adjusted by `rope_type` (default, linear, llama3)."""
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    scaling = rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inverse_frequencies(inv_freq, scaling)
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported")


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE over the full head_dim; cos/sin cached per position (float32 math,
    stored in the default dtype at construction time, i.e. the model dtype). The per-step
    tables (looked up at the step's positions) are kept for as long as the same positions
    tensor object comes back (and, outside inference mode, is unmodified) within one forward:
    every layer shares this module, so one lookup serves them all. The model calls `new_step`
    at the start of every forward, so each forward's first layer looks them up again: a CUDA
    graph captured after eager warm-up runs with the same positions tensor must record the
    lookup, not reuse the warm-up's tables. Positions are never edited in place (an inference
    tensor has no version counter to tell)."""

    def __init__(
        self, head_dim: int, max_position: int, rope_theta: float, rope_scaling: dict | None
    ) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(head_dim, rope_theta, rope_scaling)
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        dtype = torch.get_default_dtype()
        self.register_buffer("cos_cache", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin_cache", freqs.sin().to(dtype), persistent=False)
        self._step: tuple[torch.Tensor, int, torch.Tensor, torch.Tensor] | None = None

    def new_step(self) -> None:
        """Forget the per-step tables: the next `tables` call looks them up again."""
        self._step = None

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, head_dim] (cat(cos, cos), cat(-sin, sin)) at `positions` [T]."""
        step = self._step
        version = 0 if positions.is_inference() else positions._version
        if step is None or step[0] is not positions or step[1] != version:
            cos, sin = rotary_tables(self.cos_cache[positions], self.sin_cache[positions])
            step = self._step = (positions, version, cos, sin)
        return step[2], step[3]

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] (any view) -> a new rotated tensor."""
        cos, sin = self.tables(positions)
        return apply_rotary_full(x, cos, sin)

    def rotate_(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """rotate, in place on x (one C++ pass on the CPU path); returns x."""
        if (
            cpu_fast_path(x)
            and self.cos_cache.dtype == torch.float32
            and positions.dtype == torch.int64
            and positions.is_contiguous()
        ):
            torch.ops.pagedserve_cpu.rotary_inplace(x, positions, self.cos_cache, self.sin_cache)
            return x
        return x.copy_(self.rotate(positions, x))

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, num_heads, head_dim]; k [T, num_kv_heads, head_dim]."""
        return self.rotate(positions, q), self.rotate(positions, k)

    def norm_rotate_qk(
        self,
        positions: torch.Tensor,
        qk: torch.Tensor,
        num_q_heads: int,
        qk_norms: tuple[RMSNorm, RMSNorm] | None = None,
        kv_write: KVWrite | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """qk [T, q_heads + kv_heads, head_dim] (q heads first; a view of this step's own qkv
        buffer, which may be overwritten) -> (q, k, kv_written): with qk_norms = (q_norm,
        k_norm) each head normed first (Qwen3), then rotated. The Triton path is one launch in
        place on qk, which also writes the paged KV cache when given kv_write (kv_written
        says it did); the other paths rotate in place (no norms) or build new q and k."""
        if use_triton_ops(qk) and (qk_norms is None or qk_norms[0].eps == qk_norms[1].eps):
            weights: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
            eps = 1e-6
            if qk_norms is not None:
                weights, eps = (qk_norms[0].weight, qk_norms[1].weight), qk_norms[0].eps
            _triton_ops().qk_norm_rotary_(
                qk, positions, self.cos_cache, self.sin_cache, *weights, eps,
                num_q_heads=num_q_heads, kv_write=kv_write,
            )  # fmt: skip
            return qk[:, :num_q_heads], qk[:, num_q_heads:], kv_write is not None
        if qk_norms is None:
            qk = self.rotate_(positions, qk)
            return qk[:, :num_q_heads], qk[:, num_q_heads:], False
        q_norm, k_norm = qk_norms
        q, k = q_norm(qk[:, :num_q_heads]), k_norm(qk[:, num_q_heads:])
        return *self(positions, q, k), False


@functools.lru_cache(maxsize=8)
def _cached_rope(
    head_dim: int,
    max_position: int,
    rope_theta: float,
    scaling_items: tuple,
    dtype: torch.dtype,
    device: torch.device,
) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, max_position, rope_theta, dict(scaling_items) or None)


def get_rope(
    head_dim: int, max_position: int, rope_theta: float, rope_scaling: dict | None
) -> RotaryEmbedding:
    """One shared RotaryEmbedding per distinct configuration (every layer uses the same one)."""
    items = tuple(sorted((k, v) for k, v in (rope_scaling or {}).items() if _hashable(v)))
    dtype, device = torch.get_default_dtype(), torch.get_default_device()
    return _cached_rope(head_dim, max_position, rope_theta, items, dtype, device)


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton_ops(x):
            return _triton_ops().silu_and_mul(x)
        if x.dim() == 2 and cpu_fast_path(x):
            out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
            torch.ops.pagedserve_cpu.silu_and_mul(out, x)
            return out
        return silu_and_mul(x)


_FUSED_KV_WRITE_BACKENDS = ("triton", "cuda")  # their KV write is triton_attention's


class Attention(nn.Module):
    """Writes this step's k/v into the layer's paged cache, then paged attention over it.
    The model runner assigns `k_cache` / `v_cache` ([num_blocks, block_size, kv_heads, dim])."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def fusable_kv_write(self, v: torch.Tensor, metadata: AttentionMetadata) -> KVWrite | None:
        """The cache write for the q/k rotary kernel to do in its launch (the Triton path on
        a backend with the [num_blocks, block_size, kv_heads, dim] cache), or None."""
        if metadata.backend not in _FUSED_KV_WRITE_BACKENDS or not use_triton_ops(v):
            return None
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return _triton_ops().KVWrite(v, self.k_cache, self.v_cache, metadata.slot_mapping)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata,
        output_rows: OutputRows | None = None,
        kv_written: bool = False,
    ) -> torch.Tensor:
        """q [T, heads * dim], k/v [T, kv_heads * dim] -> [T, heads * dim]; with output_rows,
        every row's k/v is cached but only those rows attend -> [n, heads * dim]. kv_written:
        this step's k/v are in the cache already (see fusable_kv_write)."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if not kv_written:
            write = KV_CACHE_WRITERS[metadata.backend]
            write(k, v, self.k_cache, self.v_cache, metadata.slot_mapping)
        if output_rows is not None:
            q, metadata = q.index_select(0, output_rows.indices), output_rows.metadata
        attend = ATTENTION_BACKENDS[metadata.backend]
        out = attend(q, self.k_cache, self.v_cache, metadata, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)
