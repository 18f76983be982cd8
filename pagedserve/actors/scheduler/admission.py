"""How many requests the scheduler lets wait (admission control)."""

from __future__ import annotations

from pagedserve.config import EngineConfig


def default_max_waiting(config: EngineConfig, num_kv_blocks: int) -> int:
    """Requests allowed to wait: enough to refill the running set several times over, scaled
    with the KV cache (a cache that holds more requests drains a longer queue as fast)."""
    tokens_per_request = min(config.max_model_len or 1024, 1024)
    return max(4 * config.max_num_seqs, 2 * num_kv_blocks * config.block_size // tokens_per_request)
