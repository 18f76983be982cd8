"""What an engine's start costs on a machine without a GPU: resolving `device="auto"` does not
import torch where no GPU driver exists (torch's import is ~2 s before any actor could start),
and the CPU KV cache is zero without being written (its pages fault in as blocks are used)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from pagedserve.actors.worker.cpu_tuning import lazily_zeroed

RESOLVE = """
import json, sys
import pagedserve.config as config
config.GPU_DRIVER_PATHS = ("/no/such/driver",)
resolved = config.EngineConfig().resolve()
print(json.dumps({"device": resolved.device, "torch": "torch" in sys.modules}))
"""


def test_device_auto_without_a_gpu_driver_is_the_cpu_and_imports_no_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-c", RESOLVE], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"device": "cpu", "torch": False}


def test_a_lazily_zeroed_tensor_is_zero_writable_and_outlives_its_mapping() -> None:
    cache = lazily_zeroed((3, 2, 16, 4), torch.bfloat16)
    assert cache.shape == (3, 2, 16, 4) and cache.dtype == torch.bfloat16
    assert cache.is_contiguous() and not cache.any()
    cache[1, 0, 5] = 2.5
    assert float(cache.sum()) == 2.5 * 4 and float(cache[1, 0, 5, 3]) == 2.5
    view = cache[2]
    del cache
    view += 1  # the mapping lives as long as any tensor of it
    assert float(view.sum()) == view.numel()
