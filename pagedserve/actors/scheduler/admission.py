"""Which requests the scheduler accepts: refusals before anything is scheduled.

A prompt (with the tokens a resubmitting client holds) that can never fit is a 400: it must
leave room for output within max_model_len and within what the KV cache holds for one request
(a pooling request, which has no output, may fill them).
Beyond the waiting limit the engine is overloaded: a 503, which HTTP clients get with
Retry-After (admission control keeps the waiting queue, and memory, bounded). An admitted
request's first scheduling is counted here too (prompt tokens, prefix-cache hits).
"""

from __future__ import annotations

from pagedserve.actors.messages import AddRequest, LoRARequest, SchedulerStats
from pagedserve.actors.scheduler.request import Request
from pagedserve.config import EngineConfig


def default_max_waiting(config: EngineConfig, num_kv_blocks: int) -> int:
    """Requests allowed to wait: enough to refill the running set several times over, scaled
    with the KV cache (a cache that holds more requests drains a longer queue as fast)."""
    tokens_per_request = min(config.max_model_len or 1024, 1024)
    return max(4 * config.max_num_seqs, 2 * num_kv_blocks * config.block_size // tokens_per_request)


def refusal(
    msg: AddRequest, max_len: int, config: EngineConfig, num_waiting: int, max_waiting: int
) -> tuple[str, int] | None:
    """Why a request cannot be accepted (message, HTTP status), or None."""
    num_tokens = len(msg.prompt_token_ids) + len(msg.resume_token_ids)
    max_model_len = config.max_model_len
    if not msg.prompt_token_ids:
        return "the prompt is empty", 400
    if msg.lora is not None and not config.enable_lora:
        return "LoRA adapters need an engine started with --enable-lora", 400
    if msg.priority and config.scheduling_policy != "priority":
        return "a priority needs priority scheduling (--scheduling-policy priority)", 400
    if msg.pooling is not None and config.speculative_config is not None:
        return "embeddings need an engine without speculative decoding", 400
    if msg.pooling is not None and msg.resume_token_ids:
        return "an embedding has no output tokens to resume", 400
    room = 0 if msg.pooling is not None else 1  # for output
    if num_tokens + room > max_len:
        limit = (
            f"This model's maximum context length is {max_len} tokens"
            if max_len == max_model_len
            else f"The KV cache holds at most {max_len} tokens of one request"
        )
        rest = ", which leaves no room for output" if room else ""
        return f"{limit}; the prompt has {num_tokens} tokens{rest}.", 400
    if num_waiting >= max_waiting:
        return f"the engine is overloaded ({num_waiting} requests waiting); retry later", 503
    return None


def count(counters: SchedulerStats, req: Request, num_hit: int, prefix_caching: bool) -> None:
    """Count a request scheduled from waiting, `num_hit` of its tokens found cached."""
    if prefix_caching:
        counters.prefix_cache_queries += req.num_tokens
        counters.prefix_cache_hits += num_hit
    if req.num_cached_tokens < 0:  # first time scheduled
        req.num_cached_tokens = num_hit
        counters.num_prompt_tokens += req.num_prompt_tokens


def running_loras(running: list[Request]) -> set[LoRARequest]:
    """The adapters the running requests use (counted once a scheduling pass)."""
    return {r.lora for r in running if r.lora is not None}


def lora_fits(lora: LoRARequest, active: set[LoRARequest], config: EngineConfig) -> bool:
    """Whether an adapter can run now: it already runs, or fewer than max_loras do."""
    return lora in active or len(active) < config.max_loras
