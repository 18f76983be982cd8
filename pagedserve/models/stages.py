"""A model cut into pipeline stages (layout.PipelineStage): what one stage builds, loads and
hands to the next.

A stage builds only its own decoder layers (the others are `MissingLayer`s, so parameter names
stay the checkpoint's: model.layers.{i}.*), the embedding when it is the first stage, and the
final norm and the LM head (a classifier's score head) when it is the last. Between stages
travel the hidden states and the residual stream of every token (`StageActivations`): a
decoder layer takes both.

Loading: `checkpoint_names(stage, tied)` maps each checkpoint tensor to this stage's parameter
name, or None for a tensor of another stage (skipped before it is read). A last stage that is
not also the first has no embedding to tie its LM head to: with tied embeddings it loads the
embedding's tensor into its own LM head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.layout import PipelineStage

EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
SCORE_HEAD = "score.weight"  # a sequence classifier's head, in place of the LM head
_LAYER_PREFIX = "model.layers."


@dataclass
class StageActivations:
    """What a stage hands to the next: [num_tokens, hidden] hidden states and residuals."""

    hidden: torch.Tensor
    residual: torch.Tensor


class MissingLayer(nn.Module):
    """The place of a decoder layer another stage owns: no parameters, never run."""

    def forward(self, *args: object) -> None:
        raise RuntimeError("a decoder layer of another pipeline stage was called")


def lm_head_is_tied(stage: PipelineStage, tie_word_embeddings: bool) -> bool:
    """Whether this stage's LM head shares its embedding's weight (one stage holds both)."""
    return tie_word_embeddings and stage.is_first and stage.is_last


def checkpoint_names(
    stage: PipelineStage, tie_word_embeddings: bool
) -> Callable[[str], str | None]:
    """checkpoint tensor name -> this stage's name for it, or None when another stage owns it."""
    head_from_embedding = tie_word_embeddings and stage.is_last and not stage.is_first

    def rename(name: str) -> str | None:
        if name.startswith(_LAYER_PREFIX):
            index = int(name[len(_LAYER_PREFIX) :].split(".", 1)[0])
            return name if stage.owns_layer(index) else None
        if name == EMBEDDING:
            if head_from_embedding:
                return LM_HEAD
            return name if stage.is_first else None
        if name == LM_HEAD:
            return name if stage.is_last and not head_from_embedding else None
        if name == SCORE_HEAD:
            return name if stage.is_last else None
        if name.startswith("model.norm."):
            return name if stage.is_last else None
        return name

    return rename
