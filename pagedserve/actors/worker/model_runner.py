"""ModelRunner: owns the model shard, the paged KV cache and the persistent batch of a worker.

`execute(plan)` applies the StepPlan's diff to the persistent batch, builds the flattened
inputs of the scheduled requests (token ids, positions, KV slots, attention metadata), runs the
model, computes logits only for the last token of each request that samples this step (its
scheduled tokens reach the end of the tokens the worker knows for it), samples, and appends the
sampled tokens to the worker's own copy of each request. In a step with prefill tokens the
model's last layer, past caching every token's k/v, runs only those sampling rows
(AttentionMetadata.output_rows).

The worker pipelines steps with `launch(plan)` / `finish()`: step N+1 is queued on the device
before step N's sampled tokens reach the host (they feed N+1 on the device), and `execute` is
the two in a row. On CPU the runner tunes malloc and huge pages (cpu_tuning.py) and loads the
C++ CPU kernels (kernels.cpu_kernels, through the model loader).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch
from torch import nn

from pagedserve.actors.messages import NewRequestData, SamplingParams, StepPlan, StepResult
from pagedserve.actors.worker.cpu_tuning import advise_huge_pages, tune_cpu_malloc
from pagedserve.actors.worker.cuda_graphs import DecodeStep
from pagedserve.actors.worker.input_batch import InputBatch
from pagedserve.actors.worker.sampler import LogprobTensors, Sampler, SamplerOutput
from pagedserve.actors.worker.uploader import Uploader
from pagedserve.config import EngineConfig
from pagedserve.kernels import compile_ahead
from pagedserve.kernels.attention_metadata import (
    AttentionMetadata,
    OutputRows,
    assemble_attention_metadata,
    cdiv,
    metadata_inputs,
)
from pagedserve.models.layers import Attention
from pagedserve.models.loader import load_model

logger = logging.getLogger(__name__)

# Prefill chunk lengths for warm_up_eager_kernels: one that fits the prefill kernel's small
# query tile (for GQA groups up to 8) and one that needs its large tile.
_WARMUP_CHUNKS = (2, 128)

# The most expensive sampling settings, for the memory-profiling step.
_PROFILE_SAMPLING = SamplingParams(
    temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, presence_penalty=0.1,
    frequency_penalty=0.1, repetition_penalty=1.1, logprobs=5,
)  # fmt: skip
# The compile-only dry run's: the same filters, no logprobs (they index by the sampled ids,
# which a dry run leaves uninitialised).
_DRY_RUN_SAMPLING = msgspec.structs.replace(_PROFILE_SAMPLING, logprobs=None)


@dataclass
class PendingStep:
    """A launched step whose sampled tokens are still on their way to the host (they are in
    the runner's `sampled` buffer on the device, batch order, until the next step samples)."""

    step_id: int
    request_ids: list[str]  # the requests that sample a token, batch order
    start: float  # perf_counter() when the step's plan arrived
    host_token_ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    done: torch.cuda.Event | None = None  # recorded after the device-to-host copy
    logprobs: LogprobTensors | None = None


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64, device
    positions: torch.Tensor  # [num_tokens] int64, device
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampling] token rows whose logits are needed
    sampling_rows: np.ndarray  # [num_sampling] persistent-batch rows of the sampling requests
    sampling_ids: list[str]


def select_device(name: str, rank: int) -> torch.device:
    if name == "cuda":
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(name)


HostMetadata = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _metadata_host(
    query_lens: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, slots: np.ndarray
) -> HostMetadata:
    """(query_lens, seq_lens, block_tables, slot_mapping) as CPU tensors sharing the arrays."""
    arrays = (query_lens, seq_lens, np.ascontiguousarray(block_tables), slots)
    return tuple(torch.from_numpy(a) for a in arrays)  # type: ignore[return-value]


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        if config.max_model_len is None:
            raise ValueError("ModelRunner needs a resolved EngineConfig (call config.resolve())")
        self.config, self.rank = config, rank
        self.device = select_device(config.device, rank)
        if self.device.type == "cpu":
            tune_cpu_malloc()
        self.block_size = config.block_size
        self.input_batch = InputBatch(
            config.max_num_seqs, config.max_model_len, config.block_size, self.device
        )
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self.model: nn.Module | None = None
        self.attention_layers: list[Attention] = []
        self.kv_cache: torch.Tensor | None = None
        self.decode_step: DecodeStep | None = None  # decode steps' static path (init_kv_cache)
        self.pending: PendingStep | None = None  # the step launched last, not yet finished
        # the last step's sampled ids, batch order: the next step takes its fed tokens here
        self.sampled = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)
        self.uploader = Uploader(self.device)
        self.device_wait_s = 0.0  # host time spent waiting for steps' sampled tokens
        self.setup_seconds: dict[str, float] = {}  # load_model, memory profile, KV cache, graphs
        self._pending_index_buffer = np.full(config.max_num_seqs, -1, np.int64)
        self._host_token_buffers = [
            torch.empty(config.max_num_seqs, dtype=torch.int64, pin_memory=True)
            for _ in range(2 if self.device.type == "cuda" else 0)
        ]

    # ------------------------------------------------------------------ setup

    def _timed(self, phase: str, start: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.setup_seconds[phase] = round(time.perf_counter() - start, 3)

    def load_model(self) -> None:
        start = time.perf_counter()
        self.model = load_model(self.config, self.device)
        self.attention_backend = self.model.layer_config.attention
        self.vocab_size = int(self.model.config.vocab_size)
        self.dtype = self.model.layer_config.cache_dtype  # the KV cache's element type
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self._timed("load_model", start)

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """[layers, 2 (k, v), *one layer's cache]: [num_blocks, block_size, kv_heads_per_rank,
        head_dim], or [kv_heads_per_rank, num_blocks, block_size, head_dim] for a backend with
        the head-major layout (the CPU "torch" backend); see kernels.attention_backends."""
        layer = self.attention_layers[0]
        num_layers = len(self.attention_layers)
        per_layer = self.attention_backend.kv_cache_layer_shape(
            num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim
        )
        return (num_layers, 2, *per_layer)

    def bytes_per_block(self) -> int:
        return int(np.prod(self.kv_cache_shape(1))) * self.dtype.itemsize

    def num_kv_blocks(self) -> int:
        """config.num_kv_blocks if set; else what fits in cpu_kv_cache_gib (CPU) or in
        gpu_memory_utilization of the GPU after a profiling forward pass (CUDA)."""
        if self.config.num_kv_blocks:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            start = time.perf_counter()
            budget = self._profile_cuda_kv_budget()
            self._timed("memory_profile", start)
        else:
            budget = int(self.config.cpu_kv_cache_gib * 2**30)
        num_blocks = budget // self.bytes_per_block()
        if num_blocks < 1:
            raise RuntimeError(f"no memory left for the KV cache (budget {budget} bytes)")
        return num_blocks

    def init_kv_cache(self, num_blocks: int) -> None:
        start = time.perf_counter()
        shape = self.kv_cache_shape(num_blocks)
        self.kv_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        if self.device.type == "cpu":
            advise_huge_pages(self.kv_cache)  # before the first touch
        self._bind_kv_cache(self.kv_cache.zero_())
        self._timed("kv_cache", start)
        if self.device.type == "cuda":
            start = time.perf_counter()
            self.warm_up_eager_kernels(num_blocks)
            self._timed("kernel_warmup", start)
        start = time.perf_counter()
        self._build_decode_step()
        self._timed("cuda_graphs", start)

    def warm_up_eager_kernels(self, num_blocks: int) -> None:
        """Run a few synthetic mixed steps (a prefill chunk plus a decode) eagerly, so that
        the Triton kernel variants eager steps pick by shape (the prefill kernel's small or
        large query tile, the decode kernel with or without split-K) are compiled,
        or loaded from Triton's cache, now rather than in the middle of a run."""
        for plan, _ in self._warm_up_plans(num_blocks * self.block_size):
            self._execute_synthetic(plan)

    def _warm_up_plans(self, capacity: int) -> list[tuple[StepPlan, int]]:
        """warm_up_eager_kernels' steps for a KV cache of `capacity` tokens, each with the
        KV blocks it uses."""
        assert self.config.max_model_len is not None
        long_context = min(self.config.max_model_len, 4096, capacity - 256)
        plans = []
        for chunk, context in itertools.product(_WARMUP_CHUNKS, (16, long_context)):
            if context < 2 or chunk + context > capacity:
                continue
            greedy = SamplingParams(temperature=0.0)
            plans.append(self._synthetic_plan([(chunk, 0), (1, context - 1)], greedy))
        return plans

    def compile_kernels_ahead(self) -> None:
        """On CUDA (unless config.compile_kernels_ahead is off): a compile-only dry run of the
        start-up's steps, so that their Triton kernels compile in parallel threads rather than
        one by one as the steps meet them (kernels.compile_ahead)."""
        if not self.config.compile_kernels_ahead or self.device.type != "cuda":
            return
        if not compile_ahead.available():
            return
        start = time.perf_counter()
        with compile_ahead.compile_only():
            self.dry_run()
        self._timed("kernel_compile", start)

    @torch.inference_mode()
    def dry_run(self) -> None:
        """The start-up's steps (the memory-profiling step, sampling without logprobs; the
        eager warm-up steps; decode steps at a few batch sizes) on a temporary KV cache.
        Nothing of them stays behind."""
        config = self.config
        assert config.max_model_len is not None
        # the warm-up steps' contexts as on a cache larger than any of them
        plans = [self._profile_plan(_DRY_RUN_SAMPLING)]
        plans += self._warm_up_plans(config.max_model_len + 4096 + 256)
        num_blocks = max(blocks for _, blocks in plans)
        cache = torch.zeros(self.kv_cache_shape(num_blocks), dtype=self.dtype, device=self.device)
        self._bind_kv_cache(cache)
        try:
            for plan, _ in plans:
                self._execute_synthetic(plan)
            self._dry_run_decode_steps()
        finally:
            self._reset_after_synthetic_steps()

    def _dry_run_decode_steps(self) -> None:
        """The static decode step's function at batch sizes that specialise kernels
        differently (1 row, few rows, a multiple of 16, the largest), on padding inputs."""
        step, config = self._new_decode_step(), self.config
        for size in sorted({min(n, config.max_num_seqs) for n in (1, 2, 16, config.max_num_seqs)}):
            step.forward(size, step.metadata(size, step.max_model_len))

    def _new_decode_step(self) -> DecodeStep:
        config = self.config
        assert self.model is not None and config.max_model_len is not None
        return DecodeStep(
            self.model, self.sampled, config.max_num_seqs, config.max_model_len, self.block_size,
        )  # type: ignore[arg-type]  # fmt: skip

    def _reset_after_synthetic_steps(self) -> None:
        """Back to the engine's KV cache (if any) and a freshly seeded sampling generator."""
        if self.kv_cache is not None:
            self._bind_kv_cache(self.kv_cache)
        self.sampler.generator = torch.Generator(device=self.device)
        self.sampler.generator.manual_seed(self.config.seed)

    def _build_decode_step(self) -> None:
        """The static decode path, with its steps captured as CUDA graphs on a cuda device
        with a graph-safe backend (unless enforce_eager); a capture failure is logged and
        decode steps run the same path eagerly."""
        config = self.config
        step = self.decode_step = self._new_decode_step()
        graphs_apply = self.attention_backend.graph_safe and not config.enforce_eager
        if self.device.type != "cuda" or not graphs_apply:
            return
        try:
            with torch.inference_mode():
                step.capture()
        except Exception:
            logger.exception("CUDA graph capture failed; decode steps run eagerly")
            step.graphs.clear()

    def _bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        for layer_index, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = kv_cache[layer_index, 0], kv_cache[layer_index, 1]

    # ------------------------------------------------------------------ step

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step to completion (no step may be in flight)."""
        if self.pending is not None:
            raise RuntimeError("execute() with a step in flight: finish() it first")
        assert self.launch(plan) is None
        result = self.finish()
        assert result is not None
        return result

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> StepResult | None:
        """Queue `plan`'s step on the device without waiting for it, then finish the step
        launched before it (if any) and return that one's result. The previous step's sampled
        tokens feed this step's inputs on the device, so the host never waits between the two.
        A step whose sampling reads past tokens on the host (penalties) finishes the previous
        step first."""
        start = time.perf_counter()
        self._apply_plan(plan)
        previous = None
        if self.pending is not None and self._needs_host_tokens(plan):
            previous = self.finish()
        launched = self._launch_step(plan, start)
        if self.pending is not None:
            previous = self.finish()
        self.pending = launched
        return previous

    @torch.inference_mode()
    def finish(self) -> StepResult | None:
        """Wait for the step in flight, append its sampled tokens to the persistent batch and
        return its result (None when no step is in flight)."""
        step, self.pending = self.pending, None
        if step is None:
            return None
        result = StepResult(step_id=step.step_id, request_ids=step.request_ids,
                            sampled_token_ids=[])  # fmt: skip
        if step.request_ids:
            if step.done is not None:
                wait_start = time.perf_counter()
                step.done.synchronize()
                self.device_wait_s += time.perf_counter() - wait_start
            sampled = step.host_token_ids.numpy()
            row_of = self.input_batch.row_of
            rows = [row_of.get(r, -1) for r in step.request_ids]
            kept = np.fromiter((row >= 0 for row in rows), bool, len(rows))
            self.input_batch.append_sampled(np.asarray(rows, np.int64)[kept], sampled[kept])
            result.sampled_token_ids = sampled.tolist()
            if step.logprobs is not None:
                result.logprobs = step.logprobs.to_list()
        result.execute_ms = (time.perf_counter() - step.start) * 1e3
        return result

    def _needs_host_tokens(self, plan: StepPlan) -> bool:
        if not self.input_batch.penalty_rows:  # the usual case: no lookups per step
            return False
        row_of = self.input_batch.row_of
        rows = np.fromiter((row_of[r] for r in plan.scheduled_ids), np.int64)
        return self.input_batch.needs_token_history(rows)

    def _launch_step(self, plan: StepPlan, start: float) -> PendingStep:
        step = PendingStep(plan.step_id, [], start)
        if not plan.scheduled_ids:
            return step
        assert self.model is not None, "load_model() first"
        row_of, ids = self.input_batch.row_of, plan.scheduled_ids
        rows = np.fromiter((row_of[r] for r in ids), np.int64, len(ids))
        pending_index = self._pending_index()[rows]
        if self._is_decode_step(plan, rows, pending_index):
            step.request_ids = plan.scheduled_ids
            token_ids, step.logprobs = self._run_decode(plan, rows, pending_index)
        else:
            inputs = self._prepare_inputs(plan, rows, pending_index)
            assert self.model is not None
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn_metadata)
            if not inputs.sampling_ids:
                return step
            output = self._sample(hidden, inputs)
            step.request_ids = inputs.sampling_ids
            step.logprobs = output.logprob_tensors
            token_ids = self.sampled[: len(step.request_ids)]
            token_ids.copy_(output.token_ids)  # the next step's fed tokens
        if self.device.type == "cuda":
            host = self._host_token_buffers[plan.step_id % 2][: len(step.request_ids)]
            step.host_token_ids = host.copy_(token_ids, non_blocking=True)
            step.done = torch.cuda.Event()
            step.done.record()
        else:
            step.host_token_ids = token_ids.clone()  # the next step overwrites `sampled`
        return step

    def _is_decode_step(self, plan: StepPlan, rows: np.ndarray, pending_index: np.ndarray) -> bool:
        """Whether the static decode path runs the plan: one token per request, and every
        request samples (its token is the last one the worker knows of it)."""
        if self.decode_step is None or max(plan.num_scheduled_tokens) != 1:
            return False
        batch = self.input_batch
        known = batch.num_tokens[rows] + (pending_index >= 0)
        return bool((batch.num_computed_tokens[rows] + 1 >= known).all())

    def _run_decode(
        self, plan: StepPlan, rows: np.ndarray, pending_index: np.ndarray
    ) -> tuple[torch.Tensor, LogprobTensors | None]:
        """Write the step's inputs into the static buffers' staging views, run the step, and
        sample unless every row is plain greedy (the step's argmax). Returns the sampled ids
        (a view of `sampled`) and the logprob tensors."""
        step, batch, block_size = self.decode_step, self.input_batch, self.block_size
        assert step is not None
        num_rows = len(rows)
        positions = batch.num_computed_tokens[rows]
        seq_lens = positions + 1
        num_tokens = batch.num_tokens[rows]
        self._check_plan(plan, rows, seq_lens, num_tokens + (pending_index >= 0))
        size = step.padded_size(num_rows)
        host = step.buffers.staging()
        host.token_ids[:num_rows] = batch.token_ids[rows, positions]
        host.feed_index[:num_rows] = np.where(positions == num_tokens, pending_index, -1)
        host.positions[:num_rows] = positions
        blocks = batch.block_table_np[rows, positions // block_size]
        host.slot_mapping[:num_rows] = blocks * block_size + positions % block_size
        host.seq_lens[:num_rows] = seq_lens
        max_seq_len = int(seq_lens.max())
        width = cdiv(max_seq_len, block_size)
        host.block_tables[:num_rows, :width] = batch.block_table_np[rows, :width]
        host.pad(num_rows, size)
        batch.num_computed_tokens[rows] = seq_lens
        logits = step.run(num_rows, size, max_seq_len, host)
        token_ids = self.sampled[:num_rows]
        if batch.all_plain_greedy(rows):
            return token_ids, None
        output = self.sampler(logits, batch.sampling_metadata(rows, self.vocab_size))
        token_ids.copy_(output.token_ids)
        return token_ids, output.logprob_tensors

    def _apply_plan(self, plan: StepPlan) -> None:
        batch = self.input_batch
        for request_id in plan.finished_ids:
            batch.remove_request(request_id)
        for new_request in plan.new_requests:
            batch.add_request(new_request)
        cached = plan.cached_requests
        for request_id, block_ids, num_computed in zip(
            cached.request_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            row = batch.row_of[request_id]
            if block_ids:
                batch.append_block_ids(row, block_ids)
            batch.num_computed_tokens[row] = num_computed

    def _pending_index(self) -> np.ndarray:
        """Per persistent-batch row: the index of its token in the step in flight, or -1.
        That token sits at position num_tokens[row], known to the device only."""
        index = self._pending_index_buffer
        index.fill(-1)
        step = self.pending
        if step is not None:
            row_of = self.input_batch.row_of
            for i, request_id in enumerate(step.request_ids):
                row = row_of.get(request_id)
                if row is not None:
                    index[row] = i
        return index

    def _prepare_inputs(
        self, plan: StepPlan, rows: np.ndarray, pending_index: np.ndarray
    ) -> StepInputs:
        """The flattened inputs of any step (prefill chunks and decodes mixed)."""
        batch, block_size = self.input_batch, self.block_size
        query_lens = np.asarray(plan.num_scheduled_tokens, dtype=np.int64)
        if len(query_lens) != len(rows) or (query_lens < 1).any():
            raise ValueError(f"step {plan.step_id} needs >= 1 token per scheduled request")
        known = batch.num_tokens[rows] + (pending_index >= 0)
        computed = batch.num_computed_tokens[rows]
        seq_lens = computed + query_lens
        self._check_plan(plan, rows, seq_lens, known)
        request_of_token = np.repeat(np.arange(len(rows)), query_lens)
        query_starts = np.cumsum(query_lens) - query_lens
        offsets = np.arange(len(request_of_token)) - query_starts[request_of_token]
        positions = computed[request_of_token] + offsets
        token_rows = rows[request_of_token]
        input_ids = batch.token_ids[token_rows, positions].astype(np.int64)
        # tokens sampled by the step in flight: copied on the device from its output
        targets = np.flatnonzero(positions == batch.num_tokens[token_rows])
        sources = pending_index[request_of_token[targets]]
        blocks = batch.block_table_np[token_rows, positions // block_size].astype(np.int64)
        slot_mapping = blocks * block_size + positions % block_size
        block_tables = batch.block_table_np[rows, : cdiv(int(seq_lens.max()), block_size)]
        batch.num_computed_tokens[rows] = seq_lens
        samples = seq_lens >= known
        logits_indices = (query_starts + query_lens - 1)[samples]
        # prefill in the step: the last layer needs only the sampling rows past its k/v
        with_output_rows = 0 < len(logits_indices) < len(slot_mapping)
        host = _metadata_host(query_lens, seq_lens, block_tables, slot_mapping)
        if with_output_rows:
            rows_host = _metadata_host(
                np.ones(len(logits_indices), np.int64), seq_lens[samples],
                block_tables[samples], slot_mapping[logits_indices],
            )  # fmt: skip
        arrays = [input_ids, positions, targets, sources, logits_indices]
        for part in [host, rows_host] if with_output_rows else [host]:
            arrays += [t.numpy() for t in metadata_inputs(*part)]
        device_input_ids, device_positions, device_targets, device_sources, *rest = (
            self.uploader.upload(arrays)
        )
        device_logits_indices = rest[0]
        metadata = self._assemble(rest[1:5], host)
        if with_output_rows:
            output_rows = self._assemble(rest[5:9], rows_host)
            metadata.output_rows = OutputRows(device_logits_indices, output_rows)
        if len(targets):
            fed = self.sampled.index_select(0, device_sources)
            device_input_ids.index_copy_(0, device_targets, fed)
        return StepInputs(
            input_ids=device_input_ids,
            positions=device_positions,
            attn_metadata=metadata,
            logits_indices=device_logits_indices,
            sampling_rows=rows[samples],
            sampling_ids=[r for r, s in zip(plan.scheduled_ids, samples.tolist()) if s],
        )

    def _assemble(self, device_inputs: list[torch.Tensor], host: HostMetadata) -> AttentionMetadata:
        query_lens, seq_lens, block_tables, _ = host
        return assemble_attention_metadata(
            device_inputs, query_lens, seq_lens, block_tables, self.block_size
        )

    def _check_plan(
        self, plan: StepPlan, rows: np.ndarray, seq_lens: np.ndarray, known: np.ndarray
    ) -> None:
        batch = self.input_batch
        if (seq_lens > known).any():
            raise ValueError(f"step {plan.step_id} schedules tokens the worker does not know")
        if (seq_lens > batch.num_blocks[rows] * self.block_size).any():
            raise ValueError(f"step {plan.step_id} schedules tokens beyond the block tables")

    def _sample(self, hidden: torch.Tensor, inputs: StepInputs) -> SamplerOutput:
        assert self.model is not None
        if inputs.attn_metadata.output_rows is None:  # else hidden holds just those rows
            hidden = hidden.index_select(0, inputs.logits_indices)
        logits = self.model.compute_logits(hidden)
        metadata = self.input_batch.sampling_metadata(inputs.sampling_rows, self.vocab_size)
        return self.sampler(logits, metadata)

    # ------------------------------------------------------------------ memory profiling

    def _profile_cuda_kv_budget(self) -> int:
        """Bytes for the KV cache: gpu_memory_utilization of the device, minus what is in use
        now (weights, other processes) and the peak of a worst-case step's activations."""
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run()
        activation_peak = torch.cuda.max_memory_allocated(self.device) - baseline
        torch.cuda.empty_cache()
        return int(total * self.config.gpu_memory_utilization) - (total - free) - activation_peak

    def profile_run(self) -> None:
        """One step at the token budget through the real path: the longest prefill that fits,
        plus one-token requests up to max_num_seqs, all sampling with every filter on."""
        plan, num_blocks = self._profile_plan(_PROFILE_SAMPLING)
        self._bind_kv_cache(torch.zeros(self.kv_cache_shape(num_blocks), dtype=self.dtype,
                                        device=self.device))  # fmt: skip
        try:
            self._execute_synthetic(plan)
        finally:
            self._reset_after_synthetic_steps()

    def _profile_plan(self, sampling: SamplingParams) -> tuple[StepPlan, int]:
        """profile_run's step: the longest prefill that fits the token budget plus one-token
        requests up to max_num_seqs; and the KV blocks it uses."""
        config = self.config
        assert config.max_model_len is not None
        budget = config.max_num_batched_tokens
        num_requests = min(config.max_num_seqs, budget)
        lengths = [min(config.max_model_len, budget - num_requests + 1)] + [1] * (num_requests - 1)
        return self._synthetic_plan([(n, 0) for n in lengths], sampling)

    def _execute_synthetic(self, plan: StepPlan) -> None:
        """execute() a _synthetic_plan, then drop its requests from the persistent batch."""
        try:
            self.execute(plan)
        finally:
            for request in plan.new_requests:
                self.input_batch.remove_request(request.request_id)

    def _synthetic_plan(
        self, requests: list[tuple[int, int]], sampling: SamplingParams
    ) -> tuple[StepPlan, int]:
        """A step over made-up requests, each (tokens scheduled, tokens already computed), on
        consecutive KV blocks from block 0; returns the plan and the blocks it uses."""
        new_requests, next_block = [], 0
        for index, (scheduled, computed) in enumerate(requests):
            length = computed + scheduled
            num_blocks = cdiv(length, self.block_size)
            block_ids = list(range(next_block, next_block + num_blocks))
            next_block += num_blocks
            tokens = [index % self.vocab_size] * length
            new_requests.append(
                NewRequestData(f"synthetic-{index}", tokens, sampling, block_ids, computed)
            )
        plan = StepPlan(
            step_id=-1,
            new_requests=new_requests,
            scheduled_ids=[r.request_id for r in new_requests],
            num_scheduled_tokens=[scheduled for scheduled, _ in requests],
        )
        return plan, next_block
