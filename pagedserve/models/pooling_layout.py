"""The pooling a model directory asks for in sentence-transformers' layout, as vLLM reads it:
modules.json names the modules an embedding runs after the transformer; its
`sentence_transformers.models.Pooling` module's config.json says how the token vectors are
pooled (`pooling_mode_lasttoken`, `pooling_mode_mean_tokens`, `pooling_mode_cls_token`, ...),
and a `sentence_transformers.models.Normalize` module means the vector is normalized."""

from __future__ import annotations

import json
import os
from typing import NamedTuple

POOLING_MODULE = "sentence_transformers.models.Pooling"
NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
POOLING_MODES = {  # the Pooling module's pooling_mode_* -> the pooling type of that name
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}


class ModelPooling(NamedTuple):
    """A model directory's pooling: the pooling modes its Pooling module turns on (none
    without one) and whether a Normalize module follows."""

    modes: list[str]
    normalize: bool

    def pooling_type(self) -> str | None:
        """LAST, MEAN or CLS (None: no Pooling module); a ValueError for a pooling that
        pagedserve does not implement (max, weighted mean, several modes at once)."""
        if not self.modes:
            return None
        if len(self.modes) > 1 or self.modes[0] not in POOLING_MODES:
            raise ValueError(
                f"the model's sentence-transformers Pooling module pools by {self.modes}, "
                f"which pagedserve does not implement ({', '.join(POOLING_MODES)}); choose a "
                'pooling with --pooler-config \'{"pooling_type": "LAST"}\' (LAST, MEAN or CLS)'
            )
        return POOLING_MODES[self.modes[0]]


def model_pooling(model_path: str) -> ModelPooling | None:
    """The pooling of a model directory in sentence-transformers' layout (None: not one)."""
    modules_path = os.path.join(model_path, "modules.json")
    if not os.path.isfile(modules_path):
        return None
    with open(modules_path) as f:
        modules = json.load(f)
    normalize = any(module.get("type") == NORMALIZE_MODULE for module in modules)
    pooling = [module for module in modules if module.get("type") == POOLING_MODULE]
    if not pooling:
        return ModelPooling([], normalize)
    with open(os.path.join(model_path, pooling[0].get("path", ""), "config.json")) as f:
        settings = json.load(f)
    modes = [key for key, on in settings.items() if key.startswith("pooling_mode_") and on is True]
    return ModelPooling(modes, normalize)
