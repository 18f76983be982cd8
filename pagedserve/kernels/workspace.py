"""Grow-only scratch buffers for the pure-torch attention paths."""

from __future__ import annotations

import math

import torch


class Workspace:
    """Grow-only scratch buffers, shared by all layers (they run one after another); a buffer
    made under torch.inference_mode is replaced when asked for outside it."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        numel = math.prod(shape)
        key = (name, dtype, device)
        buffer = self._buffers.get(key)
        # a buffer made under inference mode cannot be written outside it (tests, eager use)
        stale = (
            buffer is not None and buffer.is_inference() and not torch.is_inference_mode_enabled()
        )
        if buffer is None or stale or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:numel].view(shape)

    def clear(self) -> None:
        self._buffers.clear()
