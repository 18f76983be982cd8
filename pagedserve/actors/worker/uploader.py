"""One host-to-device transfer per step for the step's small input arrays.

A step's inputs (token ids, positions, KV slots, block tables, ...) are a dozen small arrays.
Copying each one costs a pinned allocation and a copy launch, and a copy from pageable memory
can block the host until the device has drained the work queued before it, which defeats the
worker's pipelining. The uploader packs the arrays into one pinned buffer, sends it with one
non-blocking copy into one device buffer, and hands back device views of it.

Reuse: there are two pinned buffers, used in turn; a buffer is refilled only once the copy
that last read it has run (its event), which on the pipelined worker is long done. The device
buffer is overwritten by the next step's copy, which the stream orders after every kernel of
this step: views stay valid for the step's own work only. On the CPU, `upload` just wraps
the arrays.
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 16  # bytes: every view starts aligned for any dtype


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class Uploader:
    def __init__(self, device: torch.device, capacity: int = 1 << 20) -> None:
        self.device = device
        self.capacity = 0
        self.turn = 0
        self.host: list[torch.Tensor] = []
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.device_buffer = torch.empty(0, dtype=torch.uint8)
        if device.type == "cuda":
            self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        torch.cuda.synchronize(self.device)  # no copy may still read the old buffers
        self.capacity = capacity
        self.host = [torch.empty(capacity, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.copied = [None, None]
        self.device_buffer = torch.empty(capacity, dtype=torch.uint8, device=self.device)

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Device tensors with the arrays' dtypes, shapes and values (views of one buffer)."""
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        offsets, total = packed_layout(arrays)
        if total > self.capacity:
            self._allocate(max(total, 2 * self.capacity))
        host, event = self.host[self.turn], self.copied[self.turn]
        if event is not None:
            event.synchronize()
        pack(arrays, offsets, host.numpy())
        if total:
            self.device_buffer[:total].copy_(host[:total], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.copied[self.turn] = event
        self.turn ^= 1
        return unpack(self.device_buffer, arrays, offsets)


def packed_layout(arrays: list[np.ndarray]) -> tuple[list[int], int]:
    """Byte offset of each array in the packed buffer (aligned), and the bytes used."""
    offsets, total = [], 0
    for array in arrays:
        offsets.append(total)
        total += _aligned(array.nbytes)
    return offsets, total


def pack(arrays: list[np.ndarray], offsets: list[int], staging: np.ndarray) -> None:
    """Copy each array's bytes to its offset in `staging` (uint8)."""
    for array, offset in zip(arrays, offsets):
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        staging[offset : offset + flat.size] = flat


def unpack(
    buffer: torch.Tensor, arrays: list[np.ndarray], offsets: list[int]
) -> list[torch.Tensor]:
    """Views of `buffer` (uint8) with each array's dtype and shape at its offset."""
    return [
        buffer[offset : offset + array.nbytes]
        .view(torch.from_numpy(np.empty(0, array.dtype)).dtype)
        .view(array.shape)
        for array, offset in zip(arrays, offsets)
    ]
