"""vLLM's `--generation-config`: the model's `generation_config.json` gives the sampling defaults
of requests that leave a field unset ("auto", the default), or none do ("vllm"), or another
directory's file does. `--override-generation-config` (a JSON object of the same keys) is
merged over that file's values, with "vllm" too (vLLM's semantics)."""

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
    """The defaults as SamplingParams keyword arguments; ValueError for an unusable file or
    override."""
    data, source = generation_config(config)
    overrides = config.override_generation_config or {}
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise ValueError(
            f"--override-generation-config: unknown key(s) {', '.join(unknown)}; expected "
            f"{', '.join(FIELDS)}"
        )
    wrong = sorted(key for key, value in overrides.items() if not _is_number(value))
    if wrong:
        raise ValueError(f"--override-generation-config: {', '.join(wrong)} must be numbers")
    if overrides:
        data, source = data | overrides, f"{source} with --override-generation-config"
    defaults: dict[str, Any] = {}
    for key, name in FIELDS.items():
        value = data.get(key)
        if _is_number(value):
            defaults[name] = int(value) if name in INTEGER_FIELDS else float(value)
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    return defaults


def generation_config(config: EngineConfig) -> tuple[dict[str, Any], str]:
    """The generation config's fields ({} for none) and where they come from."""
    if config.generation_config == "vllm":
        return {}, "the generation config"
    auto = config.generation_config == "auto"
    directory = config.model_path if auto else config.generation_config
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        if auto:
            return {}, "the generation config"
        raise ValueError(f"--generation-config: no generation_config.json in {directory}")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return (data if isinstance(data, dict) else {}), path


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
