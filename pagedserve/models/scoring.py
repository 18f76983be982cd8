"""Teacher-forced scoring of a token sequence by a loaded model, in process: the log-probability
of each token given the ones before it (perplexity, and the quality checks of quantization).

One prefill step over the whole sequence, through the model's own layers and attention backend,
on a KV cache of its own (the backend's layout and the config's cache dtype), so quantized
weights and an fp8 KV cache are what is measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.kernels.attention_metadata import build_attention_metadata, cdiv
from pagedserve.models.layer_config import LayerConfig
from pagedserve.models.layers import Attention

BLOCK_SIZE = 16


def _bind_kv_cache(model: nn.Module, layer_config: LayerConfig, num_tokens: int) -> None:
    num_blocks = cdiv(num_tokens, BLOCK_SIZE)
    for layer in model.modules():
        if isinstance(layer, Attention):
            shape = layer_config.attention.kv_cache_layer_shape(
                num_blocks, BLOCK_SIZE, layer.num_kv_heads, layer.head_dim
            )
            layer.k_cache, layer.v_cache = (
                torch.zeros(shape, dtype=layer_config.cache_dtype, device=layer_config.device)
                for _ in range(2)
            )


@dataclass
class Scores:
    logprobs: torch.Tensor  # [n - 1] float32: log p(token_ids[i + 1] | token_ids[: i + 1])
    argmax: torch.Tensor  # [n - 1] int64: the model's greedy choice after token_ids[: i + 1]


@torch.inference_mode()
def score(model: nn.Module, token_ids: list[int]) -> Scores:
    """Every next token of `token_ids` scored under `model`, teacher-forced (one prefill)."""
    layer_config: LayerConfig = model.layer_config  # type: ignore[assignment]
    device, n = layer_config.device, len(token_ids)
    _bind_kv_cache(model, layer_config, n)
    num_blocks = cdiv(n, BLOCK_SIZE)
    metadata = build_attention_metadata(
        torch.tensor([n]),
        torch.tensor([n]),
        torch.arange(num_blocks, dtype=torch.int32)[None, :],
        torch.arange(n),
        BLOCK_SIZE,
        device,
    )
    ids = torch.tensor(token_ids, device=device)
    hidden = model(ids, torch.arange(n, device=device), metadata)
    logprobs = model.compute_logits(hidden).float().log_softmax(dim=-1)[:-1]
    chosen = logprobs.gather(1, ids[1:, None]).squeeze(1)
    return Scores(chosen.cpu(), logprobs.argmax(dim=-1).cpu())


def token_logprobs(model: nn.Module, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids) - 1] float32: log p(token_ids[i + 1] | token_ids[: i + 1])."""
    return score(model, token_ids).logprobs
