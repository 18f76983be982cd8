"""A model cut into pipeline stages: each stage holds exactly its part of the whole model's
parameters, read from the checkpoint (a tied LM head from the embedding's tensor)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.layout import PipelineStage, split_layers
from pagedserve.models.loader import build_layer_config, load_model
from pagedserve.models.model_config import load_model_config
from pagedserve.models.stages import MissingLayer
from tests.tiny_models import save_tiny_model

CPU = torch.device("cpu")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_stages_hold_exactly_their_part_of_the_model(tmp_path: Path, tied: bool) -> None:
    path = save_tiny_model("qwen3", tmp_path, num_layers=3, tie_word_embeddings=tied)
    config = EngineConfig(model=str(path), device="cpu").resolve()
    hf = load_model_config(str(path))
    whole = dict(load_model(config, CPU).named_parameters())
    seen: set[str] = set()
    bounds = split_layers(3, 2)
    assert bounds == [(0, 2), (2, 3)]
    for rank, (start, end) in enumerate(bounds):
        stage = PipelineStage(rank, 2, start, end)
        layer_config = build_layer_config(config, hf, CPU, stage=stage)
        model = load_model(config, CPU, layer_config)
        layers = model.model.layers
        assert [isinstance(layers[i], MissingLayer) for i in range(3)] == [
            not stage.owns_layer(i) for i in range(3)
        ]
        for name, param in model.named_parameters():
            source = "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name
            assert torch.equal(param, whole[source]), name
            seen.add(source)
    assert seen == set(whole)


def test_only_the_last_stage_has_the_norm_and_the_lm_head(tmp_path: Path) -> None:
    path = save_tiny_model("llama", tmp_path)
    config = EngineConfig(model=str(path), device="cpu").resolve()
    hf = load_model_config(str(path))
    first = PipelineStage(0, 2, 0, 1)
    model = load_model(config, CPU, build_layer_config(config, hf, CPU, stage=first))
    assert model.lm_head is None and model.model.norm is None
    with pytest.raises(AssertionError, match="only the last pipeline stage"):
        model.compute_logits(torch.zeros(1, 64))
