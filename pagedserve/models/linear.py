"""The linear layers and the vocabulary-parallel embedding / LM head.

Tensor parallelism (LayerConfig.tp): every parallel layer allocates only its shard and carries a
`weight_loader` on each parameter that takes the full Hugging Face tensor and copies its slice
(models.weights.load_shard, for any parameter layout). Column-parallel layers shard the output
dim (no communication); row-parallel layers shard the input dim and all-reduce their output;
the vocabulary is sharded by rows (embedding: masked lookup + all-reduce; LM head: local logits +
all-gather).

A linear layer's weights and product belong to its linear method: `UnquantizedLinearMethod`
here, or the one the LayerConfig's quantization gives (models.quantization). The method
registers the parameters on the layer (the checkpoint's form of the weights), converts them
once after loading (`process_weights_after_loading`: to the engine's form) and computes
x W^T + b (`apply`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.models.layer_config import LayerConfig

if TYPE_CHECKING:
    from pagedserve.models.lora import LoRALayer
from pagedserve.models.weights import (
    ALL_PARTS,
    VECTOR,
    OutputShard,
    default_weight_loader,
    divide,
    load_shard,
    new_parameter,
)


class LinearMethod(Protocol):
    def create_weights(self, layer: LinearBase, bias: bool) -> None:
        """Register the checkpoint's parameters on the layer (and the bias, VECTOR layout)."""

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Turn the loaded parameters into the form `apply` reads."""

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., input_per_rank] -> x W^T + bias [..., output_per_rank], x's dtype."""


def _mkldnn_linear_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(
            torch.ops.mkldnn, "_linear_pointwise"
        )
    except (AttributeError, RuntimeError):
        return False


_MKLDNN_LINEAR = _mkldnn_linear_available()


@functools.cache
def triton_gemv_module() -> ModuleType:
    """kernels.triton_gemv, imported on first use (by a layer whose config chose it)."""
    from pagedserve.kernels import triton_gemv

    return triton_gemv


@functools.cache
def triton_argmax_module() -> ModuleType:
    """kernels.triton_argmax, imported on first use (by an LM head on the Triton path)."""
    from pagedserve.kernels import triton_argmax

    return triton_argmax


# oneDNN keeps a reordered copy of the weight for every distinct row count it meets (in its
# primitive cache: ~0.6x the weight's bytes each, measured), so a CPU worker fed prefill chunks
# of every length grew without bound. Its products are taken only up to this many rows, and
# padded up to a power of two: at most 9 row counts, so the memory it holds is bounded.
ONEDNN_MAX_ROWS = 256


class DenseMatmul:
    """x W^T + b for a float weight [out, in], the implementation fixed at construction:
    with small_batch_gemm, products of at most small_batch_gemm_rows rows go through the
    Triton weight-streaming GEMM (triton_gemv.skinny_linear: cuBLAS picks poor tiles for such
    skinny shapes); float32 on the CPU, up to ONEDNN_MAX_ROWS rows, through oneDNN's linear on
    the weight reordered once (the layout Inductor uses for frozen CPU weights: ~1.3-1.6x
    faster than MKL's sgemm at small batches; reordered again when the weight changes), rows
    padded to a power of two; everything else F.linear."""

    def __init__(self, config: LayerConfig) -> None:
        self.skinny = triton_gemv_module() if config.small_batch_gemm else None
        self.skinny_rows = config.small_batch_gemm_rows
        self.dependent_launch = config.dependent_launch
        self.onednn = (
            _MKLDNN_LINEAR and config.device.type == "cpu" and config.dtype == torch.float32
        )
        self._key: tuple[int, int] | None = None
        self._packed: torch.Tensor | None = None

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if self.skinny is not None and x.numel() <= self.skinny_rows * x.shape[-1]:
            if self.skinny.skinny_linear_applies(x, weight, bias):
                return self.skinny.skinny_linear(
                    x, weight, bias, dependent_launch=self.dependent_launch
                )
        if self.onednn and not torch.is_grad_enabled():  # oneDNN's op has no autograd
            if x.numel() <= ONEDNN_MAX_ROWS * x.shape[-1]:
                return self._onednn_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def _onednn_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        key = (weight.data_ptr(), 0 if weight.is_inference() else weight._version)
        if self._key != key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)
            self._key = key
        rows = x.reshape(-1, x.shape[-1])
        num_rows = rows.shape[0]
        padded = 1 << max(0, num_rows - 1).bit_length()
        if padded != num_rows:
            rows = F.pad(rows, (0, 0, 0, padded - num_rows))
        out = torch.ops.mkldnn._linear_pointwise(rows, self._packed, bias, "none", [], "")
        return out[:num_rows].view(*x.shape[:-1], out.shape[-1])


class UnquantizedLinearMethod:
    """A float weight [output_per_rank, input_per_rank] (and bias [output_per_rank])."""

    def __init__(self, config: LayerConfig) -> None:
        self.matmul = DenseMatmul(config)

    def create_weights(self, layer: LinearBase, bias: bool) -> None:
        layer.weight = new_parameter(
            layer.output_size, layer.input_size, loader=layer.weight_loader
        )
        layer.bias = (
            new_parameter(layer.output_size, loader=layer.weight_loader, layout=VECTOR)
            if bias
            else None
        )

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        pass

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.matmul(x, layer.weight, bias)


class LinearBase(nn.Module):
    """y = x W^T + b with W [output_per_rank, input_per_rank], by the config's linear method.
    Subclasses say how checkpoint tensors map onto this rank: `output_shard(shard_id)` (None:
    every output channel) and `input_range()` (None: every input channel)."""

    bias: nn.Parameter | None
    lora: LoRALayer | None = None  # adapters' deltas (models/lora.py: enable_lora)

    def __init__(self, input_size: int, output_size: int, bias: bool, config: LayerConfig) -> None:
        super().__init__()
        self.tp = config.tp
        self.input_size, self.output_size = input_size, output_size
        self.method: LinearMethod = (
            config.quantization.linear_method(config)
            if config.quantization is not None
            else UnquantizedLinearMethod(config)
        )
        self.method.create_weights(self, bias)

    @property
    def local_output_sizes(self) -> list[int]:
        """This rank's output channels of each fused part, in order."""
        return [self.output_size]

    def output_shard(self, shard_id: str | int | None) -> OutputShard | None:
        return None

    def input_range(self) -> tuple[int, int] | None:
        return None

    def checkpoint_part_starts(self) -> dict[str | int, int]:
        """A fused layer's parts (shard id -> the first of its output channels in a checkpoint
        tensor that holds every part, in order: ALL_PARTS); empty for a layer of one part."""
        return {}

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if shard_id == ALL_PARTS:
            self._load_every_part(param, loaded)
        else:
            load_shard(param, loaded, self.output_shard(shard_id), self.input_range())

    def _load_every_part(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """A checkpoint tensor of every fused part (ALL_PARTS), each part sliced from its rows
        as from its own tensor (its tensor-parallel shard included)."""
        starts = self.checkpoint_part_starts()
        if not starts:
            raise ValueError(f"{type(self).__name__} is not a fused layer: it has no parts")
        for part, start in starts.items():
            shard = self.output_shard(part)
            assert shard is not None
            moved = dataclasses.replace(shard, source_start=start + shard.source_start)
            load_shard(param, loaded, moved, self.input_range())

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x, self.bias)
        if self.lora is not None:
            self.lora.add_delta(x, y)
        return y


class ColumnParallelLinear(LinearBase):
    """Shards the output dim: rank r holds rows [r * out/tp, (r + 1) * out/tp)."""

    def __init__(
        self, input_size: int, output_size: int, config: LayerConfig, bias: bool = False
    ) -> None:
        super().__init__(input_size, divide(output_size, config.tp.size), bias, config)

    def output_shard(self, shard_id: str | int | None) -> OutputShard | None:
        size = self.output_size
        return OutputShard(0, self.tp.rank * size, size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_up); shard_id picks the part."""

    def __init__(
        self, input_size: int, output_sizes: list[int], config: LayerConfig, bias: bool = False
    ) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), config, bias)

    @property
    def local_output_sizes(self) -> list[int]:
        return [size // self.tp.size for size in self.output_sizes]

    def output_shard(self, shard_id: str | int | None) -> OutputShard | None:
        assert isinstance(shard_id, int)
        sizes = self.local_output_sizes
        size = sizes[shard_id]
        return OutputShard(sum(sizes[:shard_id]), self.tp.rank * size, size, shard_id)

    def checkpoint_part_starts(self) -> dict[str | int, int]:
        return {part: sum(self.output_sizes[:part]) for part in range(len(self.output_sizes))}


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, sharded by heads. When tp.size exceeds the number
    of kv heads, each kv head is replicated over tp.size / num_kv_heads ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        config: LayerConfig,
        bias: bool = False,
    ) -> None:
        tp_size = config.tp.size
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = divide(num_heads, tp_size)
        if tp_size >= num_kv_heads:
            self.num_kv_heads, self.kv_replicas = 1, divide(tp_size, num_kv_heads)
        else:
            self.num_kv_heads, self.kv_replicas = divide(num_kv_heads, tp_size), 1
        local_out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, local_out * tp_size, config, bias)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def local_output_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def output_shard(self, shard_id: str | int | None) -> OutputShard | None:
        if shard_id == "q":
            return OutputShard(0, self.tp.rank * self.q_size, self.q_size, 0)
        head_start = (self.tp.rank // self.kv_replicas) * self.num_kv_heads
        start = self.q_size + (self.kv_size if shard_id == "v" else 0)
        return OutputShard(start, head_start * self.head_dim, self.kv_size, 1 + (shard_id == "v"))

    def checkpoint_part_starts(self) -> dict[str | int, int]:
        q_rows = self.total_num_heads * self.head_dim
        kv_rows = self.total_num_kv_heads * self.head_dim
        return {"q": 0, "k": q_rows, "v": q_rows + kv_rows}


class RowParallelLinear(LinearBase):
    """Shards the input dim; the partial outputs are all-reduced (bias added once)."""

    def __init__(
        self, input_size: int, output_size: int, config: LayerConfig, bias: bool = False
    ) -> None:
        super().__init__(divide(input_size, config.tp.size), output_size, bias, config)

    def input_range(self) -> tuple[int, int] | None:
        return self.tp.rank * self.input_size, self.input_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x, self.bias if self.tp.rank == 0 else None)
        if self.lora is not None:  # this rank's share of the delta, summed with the rest
            self.lora.add_delta(x, y)
        self.tp.all_reduce(y)
        return y


class VocabParallelBase(nn.Module):
    """A [vocab, hidden] weight sharded by vocabulary rows (padded: each rank holds as many)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        config: LayerConfig,
        tied_to: nn.Parameter | None,
    ) -> None:
        super().__init__()
        self.tp = config.tp
        self.vocab_size = vocab_size
        self.rows_per_rank = math.ceil(vocab_size / self.tp.size)
        self.vocab_start = self.tp.rank * self.rows_per_rank
        if tied_to is not None:
            self.weight = tied_to
        else:
            self.weight = new_parameter(self.rows_per_rank, hidden_size, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows = max(0, min(self.rows_per_rank, self.vocab_size - self.vocab_start))
        param.data.zero_()
        default_weight_loader(param.data[:rows], loaded.narrow(0, self.vocab_start, rows))


class VocabEmbedding(VocabParallelBase):
    """Token embedding; under TP a masked local lookup followed by an all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, config: LayerConfig) -> None:
        super().__init__(vocab_size, hidden_size, config, tied_to=None)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.rows_per_rank)
        y = F.embedding(local.clamp(0, self.rows_per_rank - 1), self.weight)
        y = y * in_shard.unsqueeze(-1).to(y.dtype)
        self.tp.all_reduce(y)
        return y


class LMHead(VocabParallelBase):
    """logits = hidden @ W^T over the vocabulary; shares the embedding's weight when tied."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        config: LayerConfig,
        tied_to: VocabEmbedding | None = None,
    ) -> None:
        tied_weight = tied_to.weight if tied_to is not None else None
        super().__init__(vocab_size, hidden_size, config, tied_to=tied_weight)
        self.matmul = DenseMatmul(config)
        self.fused_ops, self.dependent_launch = config.fused_ops, config.dependent_launch

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last_dim(self.matmul(hidden, self.weight, None))
        return logits[..., : self.vocab_size]

    def greedy(self, logits: torch.Tensor, out: torch.Tensor) -> None:
        """out[r] = logits[r].argmax() (greedy sampling; the first index of the maximum) for
        logits [M, vocab]: the split Triton kernel on the Triton path, torch elsewhere."""
        if self.fused_ops == "triton":
            triton_argmax_module().greedy_argmax(
                logits, out, dependent_launch=self.dependent_launch
            )
        else:
            out.copy_(logits.argmax(dim=-1))
