"""A worker's place in the TP x PP grid (layout.py) and its torch.distributed groups.

With more than one worker, every worker joins one process group of all of them (NCCL on GPUs,
gloo on the CPU) at the rendezvous network.py names, with config.collective_timeout_s as the
deadline of every collective and transfer. With pipeline parallelism each stage's ranks form
its own tensor-parallel group (every worker creates every group, in stage order, as
torch.distributed requires), and activations pass to the next stage point to point (the
StageLink of worker/pipeline.py).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedserve.actors import network
from pagedserve.config import EngineConfig
from pagedserve.layout import ParallelLayout, PipelineStage, stage_of
from pagedserve.models.layer_config import LayerConfig, TensorParallel
from pagedserve.models.loader import build_layer_config
from pagedserve.models.model_config import load_model_config


@dataclass(frozen=True)
class WorkerGroups:
    rank: int
    layout: ParallelLayout
    tp: TensorParallel
    stage: PipelineStage


def join_worker_groups(config: EngineConfig, run_dir: str, rank: int, epoch: int) -> WorkerGroups:
    layout = ParallelLayout.of(config)
    num_layers = int(load_model_config(config.model_path, config.hf_overrides).num_hidden_layers)
    stage = stage_of(config, num_layers, rank)
    if layout.world_size == 1:
        return WorkerGroups(rank, layout, TensorParallel(), stage)
    timeout = datetime.timedelta(seconds=config.collective_timeout_s)
    dist.init_process_group(
        "nccl" if config.device == "cuda" else "gloo",
        store=network.rendezvous_store(config, run_dir, epoch),
        rank=rank,
        world_size=layout.world_size,
        timeout=timeout,
    )
    tp_size = layout.tensor_parallel_size
    group = None  # the default group: every worker is one stage's tensor-parallel rank
    if layout.pipeline_parallel_size > 1 and tp_size > 1:
        stage_groups = [
            dist.new_group(layout.stage_ranks(s), timeout=timeout)
            for s in range(layout.pipeline_parallel_size)
        ]
        group = stage_groups[layout.pp_rank(rank)]
    tp = TensorParallel(rank=layout.tp_rank(rank), size=tp_size, group=group)
    return WorkerGroups(rank, layout, tp, stage)


def stage_layer_config(
    config: EngineConfig, device: torch.device, groups: WorkerGroups | None
) -> LayerConfig | None:
    """The layers' settings with this worker's tensor-parallel group and pipeline stage (None
    without groups: the loader's own, for one worker or the default group)."""
    if groups is None:
        return None
    hf_config = load_model_config(config.model_path, config.hf_overrides)
    return build_layer_config(config, hf_config, device, groups.tp, groups.stage)
