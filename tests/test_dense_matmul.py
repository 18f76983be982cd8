"""The float linear layers' matmul on the CPU (models/linear.py DenseMatmul)."""

from __future__ import annotations

import random

import psutil
import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.attention_backends import resolve_attention_backend
from pagedserve.models import linear
from pagedserve.models.layer_config import LayerConfig

CPU_FLOAT32 = LayerConfig(
    device=torch.device("cpu"), dtype=torch.float32, attention=resolve_attention_backend("torch")
)


@pytest.mark.skipif(not linear._MKLDNN_LINEAR, reason="this torch has no oneDNN linear")
def test_every_row_count_gives_f_linear_and_memory_stays_bounded() -> None:
    """Row counts from 1 to 400 (padded for oneDNN, or past its limit) all give F.linear's
    result, and 300 distinct row counts leave the process's memory about where it was: oneDNN
    keeps a weight copy per distinct row count it meets (it grew ~0.35 GB here before)."""
    torch.manual_seed(0)
    weight, bias = torch.randn(1024, 512), torch.randn(1024)
    matmul = linear.DenseMatmul(CPU_FLOAT32)
    with torch.inference_mode():
        for rows in (1, 3, 64, 65, 256, 257, 400):
            x = torch.randn(2, rows, 512)[1]  # a view: rows of a larger tensor
            torch.testing.assert_close(
                matmul(x, weight, bias), F.linear(x, weight, bias), atol=2e-4, rtol=1e-4
            )
        before = psutil.Process().memory_info().rss
        rng = random.Random(0)
        for rows in rng.sample(range(1, linear.ONEDNN_MAX_ROWS + 1), 250) + list(range(300, 350)):
            matmul(torch.randn(rows, 512), weight, None)
        grown = psutil.Process().memory_info().rss - before
    assert grown < 150 * 2**20, f"grew {grown / 2**20:.0f} MiB"
