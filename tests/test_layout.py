"""The TP x PP grid: ranks, stages, layer splits, plans in flight, which checkpoint tensors a
stage loads, and the layouts refused at start."""

from __future__ import annotations

import pytest

from pagedserve.config import EngineConfig, SpeculativeConfig
from pagedserve.layout import (
    ParallelLayout,
    PipelineStage,
    check_layout,
    plan_capacity,
    plans_in_flight,
    split_layers,
    stage_of,
)
from pagedserve.models.stages import checkpoint_names

HF = {"num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4}


def test_ranks_of_a_grid_are_stage_major() -> None:
    layout = ParallelLayout(tensor_parallel_size=2, pipeline_parallel_size=3)
    assert layout.world_size == 6
    assert [(layout.pp_rank(r), layout.tp_rank(r)) for r in range(6)] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1),
    ]  # fmt: skip
    assert layout.stage_ranks(1) == [2, 3]
    assert layout.reporting_rank == 4  # the last stage's first tensor-parallel rank


def test_layers_split_evenly_or_as_given() -> None:
    assert split_layers(4, 2) == [(0, 2), (2, 4)]
    assert split_layers(3, 2) == [(0, 2), (2, 3)]  # the extra layer before the last stage
    assert split_layers(4, 3) == [(0, 1), (1, 3), (3, 4)]  # ... from the middle out
    assert split_layers(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert split_layers(5, 2, [1, 4]) == [(0, 1), (1, 5)]


def test_stage_of_a_rank() -> None:
    config = EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert stage_of(config, 5, 1) == PipelineStage(0, 2, 0, 3)
    last = stage_of(config, 5, 2)
    assert last == PipelineStage(1, 2, 3, 5) and last.is_last and not last.is_first
    assert [last.owns_layer(i) for i in range(5)] == [False, False, False, True, True]
    assert stage_of(EngineConfig(), 5, 0).owns_layer(4)


def test_plans_in_flight_and_their_share_of_the_requests() -> None:
    assert plans_in_flight(EngineConfig(max_inflight_steps=3)) == 3  # no pipeline: as before
    assert plans_in_flight(EngineConfig(pipeline_parallel_size=4, max_inflight_steps=2)) == 4
    pp2 = EngineConfig(pipeline_parallel_size=2, max_num_seqs=8)
    assert plans_in_flight(pp2) == 3
    assert [plan_capacity(pp2, n) for n in (0, 1, 3, 4, 100)] == [1, 1, 1, 2, 3]
    assert plan_capacity(EngineConfig(max_num_seqs=8), 100) == 8
    one_at_a_time = EngineConfig(pipeline_parallel_size=2, max_inflight_steps=1, max_num_seqs=8)
    assert plans_in_flight(one_at_a_time) == 1 and plan_capacity(one_at_a_time, 5) == 5


def test_a_stage_loads_only_its_own_tensors() -> None:
    first, last = PipelineStage(0, 2, 0, 1), PipelineStage(1, 2, 1, 2)
    names = [
        "model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.self_attn.q_proj.weight", "model.norm.weight", "lm_head.weight",
    ]  # fmt: skip
    assert [checkpoint_names(first, False)(n) for n in names] == [*names[:2], None, None, None]
    assert [checkpoint_names(last, False)(n) for n in names] == [None, None, *names[2:]]
    # tied embeddings: the last stage's LM head is loaded from the embedding's tensor
    assert [checkpoint_names(last, True)(n) for n in names] == [
        "lm_head.weight", None, *names[2:4], None,
    ]  # fmt: skip
    whole = checkpoint_names(PipelineStage(), True)
    assert [whole(n) for n in names] == names


@pytest.mark.parametrize(
    ("settings", "hf", "message"),
    [
        (dict(tensor_parallel_size=3), HF, "must divide the model's 8 attention heads"),
        (dict(tensor_parallel_size=4), {**HF, "num_key_value_heads": 3}, "key/value heads"),
        (dict(pipeline_parallel_size=5), HF, "more stages than the model's 4 layers"),
        (dict(pipeline_parallel_size=2, pipeline_layer_partition=[1, 2]), HF, "4 layers in all"),
        (dict(pipeline_parallel_size=2, pipeline_layer_partition=[4, 0]), HF, "at least one"),
        (
            dict(
                pipeline_parallel_size=2,
                speculative_config=SpeculativeConfig(num_speculative_tokens=2),
            ),
            HF,
            "speculative decoding is not supported",
        ),
    ],
)
def test_impossible_layouts_are_refused(settings: dict, hf: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_layout(EngineConfig(**settings), hf, None)


def test_more_ranks_than_gpus_is_refused() -> None:
    config = EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    check_layout(config, HF, 4)
    with pytest.raises(ValueError, match="needs 4 GPUs; this machine has 2"):
        check_layout(config, HF, 2)


def test_config_rejects_unknown_executors() -> None:
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineConfig(distributed_executor_backend="slurm")
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        EngineConfig(pipeline_parallel_size=0)
