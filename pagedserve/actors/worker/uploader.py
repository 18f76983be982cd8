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


class PinnedStaging:
    """Two pinned host buffers, used in turn, and the device buffer they are copied into
    (CUDA). A host buffer is handed out for writing only once the copy that last read it has
    run; `send` copies the current one's first bytes with one non-blocking copy."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.hosts = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True) for _ in "ab"]
        self.device_buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def next_host(self) -> torch.Tensor:
        """The host buffer the next `send` copies (free to write once this returns)."""
        event = self.copied[self.turn]
        if event is not None:
            event.synchronize()
        return self.hosts[self.turn]

    def send(self, nbytes: int) -> None:
        if nbytes:
            self.device_buffer[:nbytes].copy_(self.hosts[self.turn][:nbytes], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.copied[self.turn] = event
        self.turn ^= 1


class SampledIds:
    """Copies of sampled token ids to the host, queued behind the kernels that write them: on
    a GPU into pinned buffer `slot % 2` (of `rows` ids; wait for the event, and read the copy
    before that slot is copied into again), on the CPU a clone."""

    def __init__(self, rows: int, device: torch.device) -> None:
        count = 2 if device.type == "cuda" else 0
        self.buffers = [torch.empty(rows, dtype=torch.int64, pin_memory=True) for _ in range(count)]

    def copy(
        self, token_ids: torch.Tensor, slot: int
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if not self.buffers:
            return token_ids.clone(), None
        host = self.buffers[slot % 2][: len(token_ids)].copy_(token_ids, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done


class Uploader:
    def __init__(self, device: torch.device, capacity: int = 1 << 20) -> None:
        self.device = device
        self.staging: PinnedStaging | None = None
        if device.type == "cuda":
            self.staging = PinnedStaging(capacity, device)

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Device tensors with the arrays' dtypes, shapes and values (views of one buffer)."""
        if self.staging is None:
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        offsets, total = packed_layout(arrays)
        capacity = self.staging.device_buffer.numel()
        if total > capacity:
            torch.cuda.synchronize(self.device)  # no copy may still read the old buffers
            self.staging = PinnedStaging(max(total, 2 * capacity), self.device)
        pack(arrays, offsets, self.staging.next_host().numpy())
        self.staging.send(total)
        return unpack(self.staging.device_buffer, arrays, offsets)


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
