"""Classification with a sequence classifier (vLLM's classify API): the engine gives each prompt
its labels' logits (the model's score head over the prompt's last token: worker/pooling.py);
here they become vLLM's probabilities and the likeliest label's name. Shared by `LLM.classify`
and the server's /classify."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from pagedserve.models.model_config import class_labels


class Classifier(NamedTuple):
    """A sequence classifier's labels (in index order) and transformers' `problem_type`."""

    labels: list[str]
    problem_type: str | None

    @classmethod
    def of(cls, hf_config: dict[str, Any]) -> Classifier:
        return cls(class_labels(hf_config), hf_config.get("problem_type"))

    def probabilities(self, logits: bytes) -> list[float]:
        """The labels' probabilities from the engine's logits (little-endian float32 bytes),
        by vLLM's activation (that of transformers' loss for the problem_type): the logits
        themselves for regression, a sigmoid of each for multi-label classification or a
        single label, else a softmax."""
        values = np.frombuffer(logits, dtype="<f4").astype(np.float64)
        if self.problem_type == "regression":
            return values.tolist()
        if self.problem_type == "multi_label_classification" or len(values) < 2:
            return sigmoid(values).tolist()
        exps = np.exp(values - values.max())
        return (exps / exps.sum()).tolist()

    def label(self, probs: list[float]) -> str:
        """The likeliest label's name."""
        return self.labels[int(np.argmax(probs))]


def sigmoid(values: np.ndarray) -> np.ndarray:
    """1 / (1 + e^-x), elementwise, in float64."""
    return 1.0 / (1.0 + np.exp(-np.asarray(values, dtype=np.float64)))
