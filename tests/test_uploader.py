"""The worker's step-input uploader: arrays packed into one buffer come back as typed views."""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.actors.worker.uploader import Uploader, pack, packed_layout, unpack


def step_arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        rng.integers(0, 50_000, 37, dtype=np.int64),  # token ids
        np.zeros(0, np.int64),  # no token fed from the device
        np.arange(5, dtype=np.int32),  # query_start_loc
        rng.integers(0, 900, (4, 7), dtype=np.int32)[:, :3],  # a non-contiguous block table
        rng.random(3).astype(np.float32),
        np.array([True, False, True]),
    ]


def test_packed_views_have_each_arrays_dtype_shape_and_values() -> None:
    arrays = step_arrays()
    offsets, total = packed_layout(arrays)
    assert all(offset % 16 == 0 for offset in offsets) and total % 16 == 0
    assert total >= sum(a.nbytes for a in arrays)
    staging = np.full(total + 64, 0xAB, np.uint8)
    pack(arrays, offsets, staging)
    views = unpack(torch.from_numpy(staging), arrays, offsets)
    for array, view in zip(arrays, views):
        assert view.dtype == torch.from_numpy(np.ascontiguousarray(array)).dtype
        assert tuple(view.shape) == array.shape
        np.testing.assert_array_equal(view.numpy(), array)


def test_cpu_upload_wraps_the_arrays() -> None:
    arrays = step_arrays()
    for array, tensor in zip(arrays, Uploader(torch.device("cpu")).upload(arrays)):
        np.testing.assert_array_equal(tensor.numpy(), array)
