"""vLLM's `--generation-config`: the model's `generation_config.json` gives the sampling defaults
of requests that leave a field unset ("auto", the default), or none do ("vllm"), or another
directory's file does."""

from __future__ import annotations

import json
import os
from typing import Any

from pagedserve.actors.messages import SamplingParams
from pagedserve.config import EngineConfig

# generation_config.json key -> SamplingParams field (the keys vLLM reads)
FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
INTEGER_FIELDS = ("top_k", "max_tokens")


def sampling_defaults(config: EngineConfig) -> dict[str, Any]:
    """The defaults as SamplingParams keyword arguments; ValueError for an unusable file."""
    if config.generation_config == "vllm":
        return {}
    auto = config.generation_config == "auto"
    directory = config.model_path if auto else config.generation_config
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        if auto:
            return {}
        raise ValueError(f"--generation-config: no generation_config.json in {directory}")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    defaults: dict[str, Any] = {}
    for key, name in FIELDS.items():
        value = data.get(key) if isinstance(data, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            defaults[name] = int(value) if name in INTEGER_FIELDS else float(value)
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return defaults
