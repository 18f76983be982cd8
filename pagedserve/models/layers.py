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
import math
from collections.abc import Callable
from typing import overload

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.attention import ATTENTION_BACKENDS, KV_CACHE_WRITERS, AttentionMetadata
from pagedserve.kernels.ops import apply_rotary, fused_add_rms_norm, rms_norm, silu_and_mul


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

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


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
        y = F.linear(x, self.weight, bias)
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

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            shards = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(shards, logits)
            logits = torch.cat(shards, dim=-1)
        return logits[..., : self.vocab_size]


class RMSNorm(nn.Module):
    """RMSNorm; with a residual it fuses the add: forward(x, residual) -> (normed, x + residual)."""

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
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


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
    stored in the default dtype at construction time, i.e. the model dtype)."""

    def __init__(
        self, head_dim: int, max_position: int, rope_theta: float, rope_scaling: dict | None
    ) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(head_dim, rope_theta, rope_scaling)
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        dtype = torch.get_default_dtype()
        self.register_buffer("cos_cache", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("sin_cache", freqs.sin().to(dtype), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, num_heads, head_dim]; k [T, num_kv_heads, head_dim]."""
        cos, sin = self.cos_cache[positions], self.sin_cache[positions]
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


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
        return silu_and_mul(x)


class Attention(nn.Module):
    """Writes this step's k/v into the layer's paged cache, then paged attention over it.
    The model runner assigns `k_cache` / `v_cache` ([num_blocks, block_size, kv_heads, dim])."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, heads * dim], k/v [T, kv_heads * dim] -> [T, heads * dim]."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        KV_CACHE_WRITERS[metadata.backend](k, v, self.k_cache, self.v_cache, metadata.slot_mapping)
        attend = ATTENTION_BACKENDS[metadata.backend]
        out = attend(q, self.k_cache, self.v_cache, metadata, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)
