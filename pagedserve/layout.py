"""Where an engine's workers sit: a grid of tensor-parallel x pipeline-parallel ranks.

Rank r is tensor-parallel rank `r % tp` of pipeline stage `r // tp` (vLLM's order), so the
ranks of one stage are consecutive and, placed in order, share a machine. Stage s owns a
contiguous range of the model's decoder layers; the first also holds the embedding, the last
the final norm and the LM head. Only the last stage's first tensor-parallel rank reports
sampled tokens. Pure Python (the scheduler and the supervisor use it without torch).

Impossible layouts fail at start, in `check_layout` (called by EngineConfig.resolve).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig


@dataclass(frozen=True)
class PipelineStage:
    """Stage `rank` of `size`, owning decoder layers [start_layer, end_layer) (end None: all
    the rest)."""

    rank: int = 0
    size: int = 1
    start_layer: int = 0
    end_layer: int | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def owns_layer(self, index: int) -> bool:
        return self.start_layer <= index and (self.end_layer is None or index < self.end_layer)


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    @classmethod
    def of(cls, config: EngineConfig) -> ParallelLayout:
        return cls(config.tensor_parallel_size, config.pipeline_parallel_size)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tensor_parallel_size

    def pp_rank(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def stage_ranks(self, pp_rank: int) -> list[int]:
        """The ranks of one stage: its tensor-parallel group."""
        tp = self.tensor_parallel_size
        return list(range(pp_rank * tp, (pp_rank + 1) * tp))

    @property
    def reporting_rank(self) -> int:
        """The rank that reports sampled tokens: the last stage's first tensor-parallel rank."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size


def split_layers(
    num_layers: int, num_stages: int, partition: list[int] | None = None
) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers: `partition` (layers per stage) when given, else
    as even as possible with the extra layers on the stages before the last, from the middle
    out (vLLM's rule: the first stage holds the embedding, the last the LM head)."""
    if partition is None:
        partition = [num_layers // num_stages] * num_stages
        for i in range(2, num_layers % num_stages + 2):
            partition[-i] += 1
    bounds, start = [], 0
    for count in partition:
        bounds.append((start, start + count))
        start += count
    return bounds


def stage_of(config: EngineConfig, num_layers: int, rank: int) -> PipelineStage:
    layout = ParallelLayout.of(config)
    size = layout.pipeline_parallel_size
    pp_rank = layout.pp_rank(rank)
    if size == 1:
        return PipelineStage()
    start, end = split_layers(num_layers, size, config.pipeline_layer_partition)[pp_rank]
    return PipelineStage(pp_rank, size, start, end)


def plans_in_flight(config: EngineConfig) -> int:
    """Step plans at the workers at once: max_inflight_steps (1: no overlap). With pipeline
    parallelism and overlap, one a stage (vLLM's batch queue: max_inflight_steps 2) and, at 3,
    one more, which covers the round trip from the last stage to the scheduler and back."""
    overlap, stages = config.max_inflight_steps, config.pipeline_parallel_size
    if stages == 1 or overlap == 1:
        return overlap
    return stages + overlap - 2


def plan_capacity(config: EngineConfig, num_requests: int) -> int:
    """Requests one step plan may hold, of `num_requests` running or waiting: any number; with
    pipeline parallelism its share of those that can run, so that the plans in flight hold
    disjoint requests and every stage has work. (The stages before the last never see a
    sampled token: a request with one in flight is not scheduled again until its result is
    back, and its next plan carries the token to every stage.)"""
    if config.pipeline_parallel_size == 1:
        return config.max_num_seqs
    runnable = min(config.max_num_seqs, num_requests)
    return max(1, -(-runnable // plans_in_flight(config)))


def check_layout(config: EngineConfig, hf_config: dict, num_gpus: int | None) -> None:
    """ValueError for a layout the model or the machine cannot run. num_gpus: GPUs on this
    machine when the workers run here on CUDA (None: not checked here)."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    heads = hf_config.get("num_attention_heads", 1)
    kv_heads = hf_config.get("num_key_value_heads") or heads
    layers = hf_config.get("num_hidden_layers", 1)
    if heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide the model's {heads} attention heads"
        )
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp} and the model's {kv_heads} key/value heads: one must "
            "divide the other"
        )
    if hf_config.get("intermediate_size", tp) % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} must divide the MLP size {hf_config['intermediate_size']}"
        )
    if pp > layers:
        raise ValueError(
            f"pipeline_parallel_size={pp} is more stages than the model's {layers} layers"
        )
    _check_partition(config.pipeline_layer_partition, pp, layers)
    if pp > 1 and config.speculative_config is not None:
        raise ValueError("speculative decoding is not supported with pipeline_parallel_size > 1")
    world = tp * pp
    if num_gpus is not None and world > num_gpus:
        raise ValueError(
            f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} needs {world} GPUs; "
            f"this machine has {num_gpus} (distributed_executor_backend='ray' runs across "
            "the machines of a Ray cluster)"
        )


def _check_partition(partition: list[int] | None, stages: int, layers: int) -> None:
    if partition is None:
        return
    if len(partition) != stages or min(partition) < 1 or sum(partition) != layers:
        raise ValueError(
            f"pipeline_layer_partition={partition} must give each of the {stages} stages at "
            f"least one layer, {layers} layers in all"
        )
