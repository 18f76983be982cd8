"""A sequence classifier's score head made from a causal LM's LM head at load (vLLM's
`classifier_from_token` with a `method`, in hf_overrides: Qwen3-Reranker served as
`Qwen3ForSequenceClassification`). The head is the LM head's rows of the listed tokens: for
from_2_way_softmax one label, the row of tokens[1] minus that of tokens[0] (so the sigmoid of
the score is the softmax of the two tokens' logits at tokens[1]); for no_post_processing one
label a token, its row. A model with tied embeddings takes the rows from its embedding.

The tokens are vocabulary entries, looked up in the tokenizer's tokenizer.json
(`model_config.classifier_token_ids`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedserve.models.model_config import ModelConfig, classifier_token_ids
from pagedserve.models.stages import EMBEDDING, LM_HEAD, SCORE_HEAD


def score_rows(lm_head: torch.Tensor, token_ids: list[int], method: str) -> torch.Tensor:
    """The score head's weight ([num_labels, hidden], float32) from the LM head's rows."""
    rows = lm_head[token_ids].float()
    if method == "from_2_way_softmax":
        return rows[1:2] - rows[0:1]
    return rows


def with_score_head(
    weights: Iterable[tuple[str, torch.Tensor]],
    config: ModelConfig,
    tokenizer_path: str,
    holds_embedding_and_head: bool,
) -> Iterator[tuple[str, torch.Tensor]]:
    """A stage's checkpoint tensors (named as `stages.checkpoint_names` names them for a tied
    model) with the LM head turned into the score head: the LM head's tensor (or, with tied
    embeddings, the embedding's, which goes on being the embedding where this stage holds
    both: `holds_embedding_and_head`) gives its rows of the tokens."""
    token_ids = classifier_token_ids(tokenizer_path, config.classifier_from_token)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for name, tensor in weights:
        if name == LM_HEAD or (name == EMBEDDING and tied and holds_embedding_and_head):
            yield SCORE_HEAD, score_rows(tensor, token_ids, config.method)
        if name != LM_HEAD:
            yield name, tensor
