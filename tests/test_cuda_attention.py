"""The `cuda` attention backend (csrc/paged_attention_decode.cu) on a machine without CUDA: its
module must fail to import with ImportError (it builds the kernel on import), so that the
engine falls back to another backend. The kernel itself is checked on a GPU by
scripts/gpu/bench_kernels.py (rows impl=cuda, against the torch reference)."""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.kernels import attention

MODULE = "pagedserve.kernels.cuda_attention"
CSRC = Path(__file__).resolve().parents[1] / "csrc"

needs_no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a CUDA machine builds the kernel on import"
)


@needs_no_cuda
def test_import_fails_cleanly_without_cuda() -> None:
    sys.modules.pop(MODULE, None)
    with pytest.raises(ImportError, match="CUDA"):
        importlib.import_module(MODULE)
    assert MODULE not in sys.modules


@needs_no_cuda
def test_engine_falls_back_without_cuda(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert attention.resolve_attention_backend("cuda") == "torch"
    assert "cuda" not in attention.ATTENTION_BACKENDS


def test_kernel_sources_exist() -> None:
    """The binding includes the device code; both are built (and hashed) together."""
    binding = (CSRC / "paged_attention_decode.cu").read_text()
    assert '#include "paged_attention_decode.cuh"' in binding
    assert (CSRC / "paged_attention_decode.cuh").is_file()
