"""A worker's start-up work around its ModelRunner: everything that runs before the first step.

    load_model -> compile_kernels_ahead -> num_kv_blocks -> init_kv_cache

- `num_kv_blocks`: config.num_kv_blocks, or what fits: cpu_kv_cache_gib on the CPU, or
  gpu_memory_utilization of the GPU after a profiling step at the token budget (CUDA).
- `init_kv_cache`: allocates and binds the cache, runs a few synthetic mixed steps so that the
  Triton kernel variants eager steps pick by shape are compiled now (CUDA), and builds the
  static decode path, captured as CUDA graphs on a GPU.
- `compile_kernels_ahead`: on CUDA, a compile-only dry run of those steps first, so that their
  Triton kernels compile in parallel threads (kernels.compile_ahead).

Synthetic steps run through the runner's real path on made-up requests (negative handles,
consecutive blocks from block 0) and leave nothing behind in its persistent batch. A sequence
classifier (no LM head) samples nothing: its synthetic requests pool, and it has no static
decode path (its requests all pool, and pooling steps take the general path).
"""

from __future__ import annotations

import logging
import time

import msgspec
import torch

from pagedserve.actors.messages import NewRequestData, PoolingParams, SamplingParams, StepPlan
from pagedserve.actors.worker.cpu_tuning import advise_huge_pages, lazily_zeroed
from pagedserve.actors.worker.cuda_graphs import DecodeStep
from pagedserve.actors.worker.model_runner import ModelRunner
from pagedserve.actors.worker.speculative import DraftModelProposer
from pagedserve.kernels import compile_ahead
from pagedserve.kernels.attention_metadata import cdiv

logger = logging.getLogger(__name__)

# Prefill chunk lengths for the warm-up: one that fits the prefill kernel's small query tile
# (for GQA groups up to 8) and one that needs its large tile.
_WARMUP_CHUNKS = (2, 128)

# The most expensive sampling settings, for the memory-profiling step.
_PROFILE_SAMPLING = SamplingParams(
    temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, presence_penalty=0.1,
    frequency_penalty=0.1, repetition_penalty=1.1, logprobs=5,
)  # fmt: skip
# The compile-only dry run's: the same filters, no logprobs (they index by the sampled ids,
# which a dry run leaves uninitialised).
_DRY_RUN_SAMPLING = msgspec.structs.replace(_PROFILE_SAMPLING, logprobs=None)


def num_kv_blocks(runner: ModelRunner) -> int:
    config = runner.config
    if config.num_kv_blocks:
        return config.num_kv_blocks
    if runner.device.type == "cuda":
        start = time.perf_counter()
        budget = _profile_cuda_kv_budget(runner)
        runner.timed("memory_profile", start)
    else:
        budget = int(config.cpu_kv_cache_gib * 2**30)
    blocks = budget // runner.bytes_per_block()
    if blocks < 1:
        raise RuntimeError(f"no memory left for the KV cache (budget {budget} bytes)")
    return blocks


def init_kv_cache(runner: ModelRunner, blocks: int) -> None:
    start = time.perf_counter()
    shape = runner.kv_cache_shape(blocks)
    if runner.device.type == "cpu":
        runner.kv_cache = lazily_zeroed(shape, runner.dtype)
        advise_huge_pages(runner.kv_cache)  # before the first touch
    else:
        runner.kv_cache = torch.zeros(shape, dtype=runner.dtype, device=runner.device)
    runner.bind_kv_cache(runner.kv_cache)
    draft = runner.proposer
    if isinstance(draft, DraftModelProposer):  # the draft model's own cache, same blocks
        draft_shape = draft.kv_cache_shape(blocks)
        cache = torch.zeros(draft_shape, dtype=draft.dtype, device=runner.device)
        draft.bind_kv_cache(cache, blocks)
    runner.timed("kv_cache", start)
    if runner.device.type == "cuda":
        start = time.perf_counter()
        warm_up_eager_kernels(runner, blocks)
        runner.timed("kernel_warmup", start)
    start = time.perf_counter()
    if runner.generates_tokens:  # a classifier's requests all pool: no static path
        _build_decode_step(runner)
    runner.timed("cuda_graphs", start)


def warm_up_eager_kernels(runner: ModelRunner, blocks: int) -> None:
    """Synthetic mixed steps (a prefill chunk plus a decode), run eagerly, so that the Triton
    kernel variants eager steps pick by shape (the prefill kernel's small or large query tile,
    the decode kernel with or without split-K) are compiled, or loaded from Triton's cache,
    now rather than in the middle of a run."""
    for plan, _ in _warm_up_plans(runner, blocks * runner.block_size):
        _execute_synthetic(runner, plan)


def compile_kernels_ahead(runner: ModelRunner) -> None:
    """On CUDA (unless config.compile_kernels_ahead is off): a compile-only dry run of the
    start-up's steps, so that their Triton kernels compile in parallel threads rather than one
    by one as the steps meet them."""
    if not runner.config.compile_kernels_ahead or runner.device.type != "cuda":
        return
    if not compile_ahead.available():
        return
    start = time.perf_counter()
    with compile_ahead.compile_only():
        dry_run(runner)
    runner.timed("kernel_compile", start)


@torch.inference_mode()
def dry_run(runner: ModelRunner) -> None:
    """The start-up's steps (the memory-profiling step, sampling without logprobs; the eager
    warm-up steps; decode steps at a few batch sizes) on a temporary KV cache. Nothing of them
    stays behind."""
    config = runner.config
    assert config.max_model_len is not None
    # the warm-up steps' contexts as on a cache larger than any of them
    plans = [_profile_plan(runner, _DRY_RUN_SAMPLING)]
    plans += _warm_up_plans(runner, config.max_model_len + 4096 + 256)
    blocks = max(used for _, used in plans)
    cache = torch.zeros(runner.kv_cache_shape(blocks), dtype=runner.dtype, device=runner.device)
    runner.bind_kv_cache(cache)
    try:
        for plan, _ in plans:
            _execute_synthetic(runner, plan)
        if not runner.generates_tokens:
            return
        step = runner.new_decode_step()
        for size in sorted({min(n, config.max_num_seqs) for n in (1, 2, 16, config.max_num_seqs)}):
            step.forward(size, step.metadata(size, step.max_model_len))
    finally:
        _rebind_engine_cache(runner)


def profile_run(runner: ModelRunner) -> None:
    """One step at the token budget through the real path: the longest prefill that fits,
    plus one-token requests up to max_num_seqs, all sampling with every filter on."""
    plan, blocks = _profile_plan(runner, _PROFILE_SAMPLING)
    cache = torch.zeros(runner.kv_cache_shape(blocks), dtype=runner.dtype, device=runner.device)
    runner.bind_kv_cache(cache)
    try:
        _execute_synthetic(runner, plan)
    finally:
        _rebind_engine_cache(runner)


def _profile_cuda_kv_budget(runner: ModelRunner) -> int:
    """Bytes for the KV cache: gpu_memory_utilization of the device, minus what is in use now
    (weights, other processes) and the peak of a worst-case step's activations."""
    device = runner.device
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    baseline = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    profile_run(runner)
    activation_peak = torch.cuda.max_memory_allocated(device) - baseline
    torch.cuda.empty_cache()
    return int(total * runner.config.gpu_memory_utilization) - (total - free) - activation_peak


def _build_decode_step(runner: ModelRunner) -> None:
    """The static decode path, with its steps captured as CUDA graphs on a cuda device with a
    graph-safe backend (unless enforce_eager); a capture failure is logged and decode steps run
    the same path eagerly."""
    step = runner.decode_step = runner.new_decode_step()
    graphs_apply = runner.attention_backend.graph_safe and not runner.config.enforce_eager
    if runner.device.type != "cuda" or not graphs_apply:
        return
    captures = [(step.capture, step.graphs.clear)]
    if isinstance(runner.proposer, DraftModelProposer):  # the draft's k decodes as graphs
        chain = runner.proposer.chain
        captures.append((lambda: chain.capture(step), chain.drop_graphs))
    for capture, drop in captures:
        try:
            with torch.inference_mode():
                capture()
        except Exception:
            logger.exception("CUDA graph capture failed; decode steps run eagerly")
            drop()
    # a short prompt's chunk replays a decode graph rather than the eager prefill launches
    runner.static_prefill = bool(step.graphs) and runner.link is None
    if runner.static_prefill:
        _capture_prefill_graphs(runner, step)


def _capture_prefill_graphs(runner: ModelRunner, step: DecodeStep) -> None:
    """A lone prompt chunk's graphs (prefill_graphs.py) in the decode graphs' pool; a
    capture failure is logged and such chunks stay decode-graph rows."""
    start = time.perf_counter()
    prefill = runner.new_prefill_step()
    if not prefill.sizes:
        return
    try:
        with torch.inference_mode():
            prefill.capture(step.pool)
    except Exception:
        logger.exception("prefill graph capture failed; prompt chunks run as decode rows")
        return
    runner.prefill_step = prefill
    runner.timed("prefill_graphs", start)


def _warm_up_plans(runner: ModelRunner, capacity: int) -> list[tuple[StepPlan, int]]:
    """The warm-up steps for a KV cache of `capacity` tokens, each with the blocks it uses: a
    prefill chunk and a decode in one step, or in two steps when max_num_seqs is 1; chunks cut
    to what a step of this engine can hold (max_model_len, the token budget)."""
    config = runner.config
    assert config.max_model_len is not None
    long_context = min(config.max_model_len, 4096, capacity - 256)
    largest_chunk = min(config.max_model_len, config.max_num_batched_tokens - 1)
    greedy = SamplingParams(temperature=0.0)
    plans = []
    contexts = (min(16, config.max_model_len), long_context)
    shapes = {(min(chunk, largest_chunk), ctx) for chunk in _WARMUP_CHUNKS for ctx in contexts}
    for chunk, context in sorted(shapes):
        if chunk < 1 or context < 2 or chunk + context > capacity:
            continue
        mixed = [(chunk, 0), (1, context - 1)]
        steps = [mixed] if config.max_num_seqs >= 2 else [[part] for part in mixed]
        plans += [_synthetic_plan(runner, requests, greedy) for requests in steps]
    return plans


def _profile_plan(runner: ModelRunner, sampling: SamplingParams) -> tuple[StepPlan, int]:
    """profile_run's step: the longest prefill that fits the token budget plus one-token
    requests up to max_num_seqs; and the KV blocks it uses."""
    config = runner.config
    assert config.max_model_len is not None
    budget = config.max_num_batched_tokens
    num_requests = min(config.max_num_seqs, budget)
    lengths = [min(config.max_model_len, budget - num_requests + 1)] + [1] * (num_requests - 1)
    return _synthetic_plan(runner, [(n, 0) for n in lengths], sampling)


def _synthetic_plan(
    runner: ModelRunner, requests: list[tuple[int, int]], sampling: SamplingParams
) -> tuple[StepPlan, int]:
    """A step over made-up requests, each (tokens scheduled, tokens already computed), on
    consecutive KV blocks from block 0 (pooling ones for a classifier); returns the plan and
    the blocks it uses."""
    pooling = None if runner.generates_tokens else PoolingParams()
    new_requests, next_block = [], 0
    for index, (scheduled, computed) in enumerate(requests):
        length = computed + scheduled
        blocks = cdiv(length, runner.block_size)
        block_ids = list(range(next_block, next_block + blocks))
        next_block += blocks
        tokens = [index % runner.vocab_size] * length
        handle = -1 - index  # engine handles are never negative
        new_requests.append(
            NewRequestData(
                handle, tokens, length, sampling, index, block_ids, computed, pooling=pooling
            )
        )
    plan = StepPlan(
        step_id=-1,
        new_requests=new_requests,
        scheduled=[r.handle for r in new_requests],
        num_scheduled_tokens=[scheduled for scheduled, _ in requests],
    )
    return plan, next_block


def _execute_synthetic(runner: ModelRunner, plan: StepPlan) -> None:
    """execute() a synthetic plan, then drop its requests from the persistent batch."""
    try:
        runner.execute(plan)
    finally:
        for request in plan.new_requests:
            runner.input_batch.remove_request(request.handle)


def _rebind_engine_cache(runner: ModelRunner) -> None:
    if runner.kv_cache is not None:
        runner.bind_kv_cache(runner.kv_cache)
