"""The inputs of decode steps in static buffers: one device buffer with a fixed layout, filled
from a pinned host staging buffer of the same layout by one copy per step.

A decode step (one token per request) needs, per batch row: the token id the host knows (or
the index of the token to take from the previous step's sampled ids, still on the device),
its position, its KV slot, its context length and its block-table row. The host writes these
straight into numpy views of the staging buffer, and `upload(rows)` sends the used prefix of the
layout (every small field whole, then the first `rows` block-table rows) in one non-blocking
copy. CUDA graphs captured on the device views read every step's inputs from the same
addresses, so a step needs no per-field copies.

Reuse: the pinned staging buffers are the uploader's PinnedStaging (two, used in turn, each
refilled only once the copy that last read it has run). The device buffer is overwritten by the
next step's copy, which the stream orders after every kernel of this step. On the CPU the
device buffer is the staging buffer and `upload` does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

from pagedserve.actors.worker.uploader import PinnedStaging

_ALIGN = 16  # bytes

# (name, dtype); each is one value per batch row. The block table comes last (see upload).
ROW_FIELDS: tuple[tuple[str, np.dtype], ...] = (
    ("token_ids", np.dtype(np.int64)),  # the token when the host knows it
    ("feed_index", np.dtype(np.int64)),  # index into the previous step's sampled ids, or -1
    ("positions", np.dtype(np.int64)),
    ("slot_mapping", np.dtype(np.int64)),  # -1: write no KV (padding rows)
    ("seq_lens", np.dtype(np.int32)),  # context length including this token
)
BLOCK_TABLE_DTYPE = np.dtype(np.int32)

T = TypeVar("T", np.ndarray, torch.Tensor)


@dataclass
class DecodeFields(Generic[T]):
    """One view per input of a decode step: [max_batch] each, block_tables
    [max_batch, max_blocks]. Numpy views of a staging buffer or tensors of the device buffer."""

    token_ids: T
    feed_index: T
    positions: T
    slot_mapping: T
    seq_lens: T
    block_tables: T

    def pad(self, start: int, stop: int) -> None:
        """Rows [start, stop) as padding: token 0, nothing fed, position 0, no KV written, a
        context of one key (block-table rows keep old, valid block ids)."""
        self.token_ids[start:stop] = 0
        self.feed_index[start:stop] = -1
        self.positions[start:stop] = 0
        self.slot_mapping[start:stop] = -1
        self.seq_lens[start:stop] = 1


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class DecodeLayout:
    """Byte offsets of each field in a buffer sized for max_batch rows."""

    def __init__(self, max_batch: int, max_blocks: int) -> None:
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.offsets: dict[str, int] = {}
        offset = 0
        for name, dtype in ROW_FIELDS:
            self.offsets[name] = offset
            offset += _aligned(max_batch * dtype.itemsize)
        self.offsets["block_tables"] = offset
        self.row_bytes = max_blocks * BLOCK_TABLE_DTYPE.itemsize
        self.nbytes = offset + max_batch * self.row_bytes

    def used_bytes(self, rows: int) -> int:
        """The prefix holding every small field and the first `rows` block-table rows."""
        return self.offsets["block_tables"] + rows * self.row_bytes

    def numpy_views(self, buffer: np.ndarray) -> DecodeFields[np.ndarray]:
        views = {
            name: buffer[self.offsets[name] :][: self.max_batch * dtype.itemsize].view(dtype)
            for name, dtype in ROW_FIELDS
        }
        table = buffer[self.offsets["block_tables"] :][: self.max_batch * self.row_bytes]
        views["block_tables"] = table.view(BLOCK_TABLE_DTYPE).reshape(
            self.max_batch, self.max_blocks
        )
        return DecodeFields(**views)

    def tensor_views(self, buffer: torch.Tensor) -> DecodeFields[torch.Tensor]:
        views = {}
        for name, dtype in ROW_FIELDS:
            start = self.offsets[name]
            raw = buffer[start : start + self.max_batch * dtype.itemsize]
            views[name] = raw.view(_torch_dtype(dtype))
        start = self.offsets["block_tables"]
        raw = buffer[start : start + self.max_batch * self.row_bytes]
        views["block_tables"] = raw.view(torch.int32).view(self.max_batch, self.max_blocks)
        return DecodeFields(**views)


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


class DecodeBuffers:
    def __init__(self, max_batch: int, max_blocks: int, device: torch.device) -> None:
        self.layout = DecodeLayout(max_batch, max_blocks)
        self.pinned: PinnedStaging | None = None
        if device.type == "cuda":
            self.pinned = PinnedStaging(self.layout.nbytes, device)
            self.device_buffer = self.pinned.device_buffer
            hosts = self.pinned.hosts
        else:  # the staging buffer is the device buffer
            self.device_buffer = torch.zeros(self.layout.nbytes, dtype=torch.uint8)
            hosts = [self.device_buffer]
        self.tensors = self.layout.tensor_views(self.device_buffer)
        self.host_views = [self.layout.numpy_views(h.numpy()) for h in hosts]
        for views in self.host_views:
            views.pad(0, max_batch)
        self.upload(max_batch)

    def staging(self) -> DecodeFields[np.ndarray]:
        """Numpy views of the staging buffer the next upload sends (free to write now)."""
        if self.pinned is None:
            return self.host_views[0]
        self.pinned.next_host()
        return self.host_views[self.pinned.turn]

    def host_aliases(self) -> DecodeFields[np.ndarray] | None:
        """Numpy views of the device buffer itself where it is host memory (the CPU), else
        None: what kernels write into the device buffer, the host reads there."""
        return self.host_views[0] if self.pinned is None else None

    def upload(self, rows: int) -> None:
        """Send the staging buffer's used prefix for `rows` rows to the device buffer."""
        if self.pinned is not None:
            self.pinned.send(self.layout.used_bytes(rows))
