"""ModelRunner: a worker's model shard, paged KV cache and persistent batch, and its steps.

A step applies the StepPlan's diff to the persistent batch (its cache of the scheduler's
requests, keyed by handle), runs the model over the scheduled tokens, computes logits only for
the requests that sample this step, samples, and appends the sampled tokens to its copy of each
request. Decode steps (one token per request, each one sampling), short chunks and a lone
prompt's chunk take the static paths (static_paths.py: replayed CUDA graphs); every other step
(and any with a pooling request, whose prompt's hidden states become an embedding: pooling.py)
builds its flattened inputs in step_inputs.py.

The worker pipelines steps with `launch(plan)` / `finish()`: step N+1 is queued on the device
before step N's sampled tokens reach the host (they feed N+1 on the device), and `execute` is
the two in a row. Start-up work (sizing the KV cache with a profiling step, warm-up, the
compile-only dry run, graph capture) lives beside this in startup.py. A pipeline stage
(worker/pipeline.py) learns sampled tokens from the plans instead.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import compress

import numpy as np
import torch
from torch import nn

from pagedserve.actors.messages import StepPlan, StepResult
from pagedserve.actors.worker.cpu_tuning import tune_cpu_malloc
from pagedserve.actors.worker.cuda_graphs import DecodeStep
from pagedserve.actors.worker.input_batch import InputBatch
from pagedserve.actors.worker.lora_slots import LoRASlots
from pagedserve.actors.worker.parallel_groups import WorkerGroups, stage_layer_config
from pagedserve.actors.worker.pipeline import StageDecodeStep, StageLink, run_stage
from pagedserve.actors.worker.pooling import PooledVectors, Pooler
from pagedserve.actors.worker.prefill_graphs import PrefillStep, prefill_rows
from pagedserve.actors.worker.prompt_logprobs import PromptLogprobTensors
from pagedserve.actors.worker.sampler import LogprobTensors, Sampler, SamplerOutput
from pagedserve.actors.worker.speculative import Proposer, decode_rows, make_proposer
from pagedserve.actors.worker.static_paths import StaticPaths
from pagedserve.actors.worker.static_rows import static_rows
from pagedserve.actors.worker.step_inputs import StepInputBuilder, StepInputs
from pagedserve.actors.worker.step_logits import RowOutputs, StepLogits
from pagedserve.actors.worker.structured import StructuredOutputs
from pagedserve.actors.worker.uploader import SampledIds, Uploader
from pagedserve.actors.worker.verify_step import speculative_step
from pagedserve.config import EngineConfig, read_hf_config
from pagedserve.models.layers import Attention
from pagedserve.models.loader import load_model


@dataclass
class PendingStep:
    """A launched step whose sampled tokens are still on their way to the host (they are in
    the runner's `sampled` buffer on the device, batch order, until the next step samples);
    or a step run to completion (speculative decoding), its `result` ready."""

    step_id: int
    handles: list[int]  # the requests that sample a token, batch order
    host_token_ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    done: torch.cuda.Event | None = None  # recorded after the device-to-host copy
    logprobs: LogprobTensors | None = None
    result: StepResult | None = None  # a step already finished: its tokens are on the host
    prompt_logprobs: PromptLogprobTensors | None = None
    pooled: PooledVectors | None = None


def select_device(name: str, rank: int) -> torch.device:
    if name == "cuda":
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(name)


def _pieces(
    rows: np.ndarray, counts: list[int], flat: list[int]
) -> Iterator[tuple[int, list[int]]]:
    """(row, its piece of `flat`) for each row with a nonzero count: a plan's flat lists
    (CachedRequestData) split per request."""
    if not flat:
        return
    ends = np.cumsum(counts).tolist()
    for i in np.flatnonzero(counts).tolist():
        yield int(rows[i]), flat[ends[i] - counts[i] : ends[i]]


class ModelRunner(StaticPaths):
    def __init__(
        self, config: EngineConfig, rank: int = 0, groups: WorkerGroups | None = None
    ) -> None:
        if config.max_model_len is None:
            raise ValueError("ModelRunner needs a resolved EngineConfig (call config.resolve())")
        self.config, self.rank, self.groups = config, rank, groups
        self.link: StageLink | None = None  # pipeline parallelism: set by load_model
        # every stage learns sampled tokens from the plans (scheduler: new_token_ids)
        self.tokens_from_plans = config.pipeline_parallel_size > 1
        self.device = select_device(config.device, rank)
        if self.device.type == "cpu":
            tune_cpu_malloc()
        self.block_size = config.block_size
        self.input_batch = InputBatch(
            config.max_num_seqs, config.max_model_len, config.block_size, self.device
        )
        self.sampler = Sampler(use_triton=self.device.type == "cuda")
        self.model: nn.Module | None = None
        self.proposer: Proposer | None = None  # speculative decoding's drafts (load_model)
        self.lora_slots: LoRASlots | None = None  # enable_lora: the adapters (load_model)
        self.attention_layers: list[Attention] = []
        self.kv_cache: torch.Tensor | None = None
        self.decode_step: DecodeStep | None = None  # decode steps' static path (startup.py)
        # prompt chunks too take the static path (as rows: static_rows.py); startup.py turns
        # it on where the path's graphs were captured
        self.static_prefill = False
        # a lone request's prompt chunk replays its own graphs (prefill_graphs.py); startup.py
        # sets it where they were captured
        self.prefill_step: PrefillStep | None = None
        self.pending: PendingStep | None = None  # the step launched last, not yet finished
        vocab_size = int(read_hf_config(config.model_path, config.hf_overrides)["vocab_size"])
        self.structured = StructuredOutputs(config, vocab_size, self.device)  # grammar masks
        self.settled: StepResult | None = None  # the result of the step finished during launch
        # the last step's sampled ids, batch order: the next step takes its fed tokens here
        self.sampled = torch.zeros(decode_rows(config), dtype=torch.int64, device=self.device)
        self.uploader = Uploader(self.device)
        self.pooler = Pooler(config.pooler_config, self.input_batch)  # embeddings
        self.inputs = StepInputBuilder(
            self.input_batch, self.uploader, self.sampled, self.block_size, self.pooler
        )
        self.device_wait_s = 0.0  # host time spent waiting for steps' sampled tokens
        self.setup_seconds: dict[str, float] = {}  # load_model and the start-up phases
        self._pending_index_buffer = np.full(config.max_num_seqs, -1, np.int64)
        self.sampled_ids = SampledIds(config.max_num_seqs, self.device)  # to the host

    def close(self) -> None:
        """Stop the threads the runner started (grammar compiles)."""
        self.structured.close()

    # ------------------------------------------------------------------ model and cache

    def timed(self, phase: str, start: float) -> None:
        """Record a set-up phase's seconds (after the device's work in it)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.setup_seconds[phase] = round(time.perf_counter() - start, 3)

    def load_model(self) -> None:
        start = time.perf_counter()
        layer_config = stage_layer_config(self.config, self.device, self.groups)
        self.model = load_model(self.config, self.device, layer_config)
        self.attention_backend = self.model.layer_config.attention
        self.vocab_size = int(self.model.config.vocab_size)
        self.dtype = self.model.layer_config.cache_dtype  # the KV cache's element type
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.proposer = make_proposer(self.config, self.device)
        self.logits = StepLogits(
            self.model.compute_logits, self.structured, self._settle_pending, self.pooler
        )
        self.generates_tokens = bool(self.model.generates_tokens)  # False: a classifier
        if not self.generates_tokens:  # its requests all pool, through its score head
            self.pooler.head = self.model.classify
        self.link = StageLink.of(self.groups, self.model, self.device)
        if self.config.enable_lora:
            self.lora_slots = LoRASlots(self.model, self.config, self.device)
            self.inputs.narrow_last_layer = False
        self.timed("load_model", start)

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
        """KV bytes of one block: the target's, and a draft model's own cache."""
        shapes = [self.kv_cache_shape(1)]
        if hasattr(self.proposer, "kv_cache_shape"):
            shapes.append(self.proposer.kv_cache_shape(1))  # type: ignore[union-attr]
        return sum(int(np.prod(shape)) for shape in shapes) * self.dtype.itemsize

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        for layer_index, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = kv_cache[layer_index, 0], kv_cache[layer_index, 1]

    def new_decode_step(self) -> DecodeStep:
        config = self.config
        assert self.model is not None and config.max_model_len is not None
        sizes = (decode_rows(config), config.max_model_len, self.block_size)
        if self.link is not None:
            return StageDecodeStep(self.model, self.sampled, *sizes, self.link)  # type: ignore[arg-type]
        longest_chunk = min(config.max_num_batched_tokens, config.max_model_len)
        rows = prefill_rows(config.prefill_graph_sizes, longest_chunk)
        return DecodeStep(
            self.model, self.sampled, *sizes, buffer_rows=rows, adapters=self.lora_slots,  # type: ignore[arg-type]
        )  # fmt: skip

    def new_prefill_step(self) -> PrefillStep:
        """The lone-prompt path over the decode step's buffers (call after it is built)."""
        assert self.decode_step is not None
        return PrefillStep(self.decode_step, self.config.prefill_graph_sizes)

    # ------------------------------------------------------------------ steps

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
        A step whose sampling reads past tokens on the host (penalties, bad words) finishes the
        previous step first."""
        self.settled = None
        if self.tokens_from_plans and self.device.type != "cuda":
            self._settle_pending()  # a CPU stage would block in its transfer, the last unreported
        self._apply_plan(plan)
        speculative = self.proposer is not None and (plan.propose or any(plan.spec_token_ids))
        if speculative or self._needs_host_tokens(plan):
            self._settle_pending()
        if speculative:  # run to completion: the next drafts need this step's tokens
            launched = PendingStep(plan.step_id, [], result=speculative_step(self, plan))
        else:
            launched = self.launch_plain(plan)
        self._settle_pending()
        self.pending = launched
        return self.settled

    def _settle_pending(self) -> None:
        """Finish the step in flight now (launch returns its result); a step whose grammar
        masks need its tokens calls this once its own forward is queued (step_logits.py)."""
        if self.pending is not None:
            self.settled = self.finish()

    @torch.inference_mode()
    def finish(self) -> StepResult | None:
        """Wait for the step in flight, append its sampled tokens to the persistent batch and
        return its result (None when no step is in flight)."""
        step, self.pending = self.pending, None
        if step is None or step.result is not None:
            return None if step is None else step.result
        result = StepResult(step_id=step.step_id, handles=step.handles, sampled_token_ids=[])
        if step.handles:
            if step.done is not None:
                wait_start = time.perf_counter()
                step.done.synchronize()
                self.device_wait_s += time.perf_counter() - wait_start
            sampled = step.host_token_ids.numpy()
            row_of = self.input_batch.row_of
            rows = [row_of.get(h, -1) for h in step.handles]
            kept = np.fromiter((row >= 0 for row in rows), bool, len(rows))
            if not self.tokens_from_plans:  # else every stage appends them from the next plan
                self.input_batch.append_sampled(np.asarray(rows, np.int64)[kept], sampled[kept])
            result.sampled_token_ids = sampled.tolist()
            if step.logprobs is not None:
                result.logprobs = step.logprobs.to_list()
            result.grammar_done = self.structured.accept_sampled(step.handles, rows, sampled)
        if step.prompt_logprobs is not None:
            result.prompt_logprobs = step.prompt_logprobs.to_wire()
        if step.pooled is not None:
            result.pooled = step.pooled.to_wire()
        return result

    def _apply_plan(self, plan: StepPlan) -> None:
        batch = self.input_batch
        for handle in plan.finished:
            if handle in batch.row_of:
                self.structured.remove(batch.row_of[handle])
            batch.remove_request(handle)
        for new_request in plan.new_requests:
            row = batch.add_request(new_request)
            if self.lora_slots is not None:
                self.lora_slots.assign(row, new_request.lora, list(batch.row_of.values()))
            output_ids = new_request.token_ids[new_request.num_prompt_tokens :]
            self.structured.add(row, new_request.sampling.structured_outputs, output_ids)
        cached = plan.cached_requests
        num_cached = len(cached.num_computed_tokens)
        if num_cached:
            row_of = batch.row_of.__getitem__
            rows = np.fromiter(map(row_of, plan.scheduled[:num_cached]), np.int64, num_cached)
            batch.num_computed_tokens[rows] = cached.num_computed_tokens
            for row, block_ids in _pieces(rows, cached.num_new_blocks, cached.new_block_ids):
                batch.append_block_ids(row, block_ids)
            for row, token_ids in _pieces(rows, cached.num_new_tokens, cached.new_token_ids):
                batch.append_tokens(row, token_ids)
        for handle, drafts in zip(plan.scheduled, plan.spec_token_ids):
            if drafts:
                batch.write_drafts(batch.row_of[handle], drafts)
        if self.proposer is not None and self.proposer.coverage is not None:
            self.proposer.coverage.track(plan, batch)  # a draft model's KV cache

    def _needs_host_tokens(self, plan: StepPlan) -> bool:
        if not self.input_batch.history_rows:  # the usual case: no lookups per step
            return False
        row_of = self.input_batch.row_of
        rows = np.fromiter((row_of[h] for h in plan.scheduled), np.int64)
        return self.input_batch.needs_token_history(rows)

    def launch_plain(self, plan: StepPlan) -> PendingStep:
        """Queue a step without speculation (it finishes with `finish`)."""
        step = PendingStep(plan.step_id, [])
        if not plan.scheduled:
            return step
        assert self.model is not None, "load_model() first"
        row_of, handles = self.input_batch.row_of, plan.scheduled
        rows = np.fromiter((row_of[h] for h in handles), np.int64, len(handles))
        if self.lora_slots is not None:
            self.lora_slots.prepare(rows, plan.num_scheduled_tokens)
        pending_index = self._pending_index()[rows]
        if self._is_lone_prefill(plan, rows):
            layout = static_rows(
                self.input_batch, rows, plan.num_scheduled_tokens, pending_index, self.block_size
            )
            step.handles = [h for h, s in zip(handles, layout.samples.tolist()) if s]
            samples = bool(layout.samples[0])
            token_ids, step.logprobs = self.run_prefill(
                layout.rows, layout.positions, layout.feed_index, samples
            )
        elif self._is_decode_step(plan, rows, pending_index):
            layout = static_rows(
                self.input_batch, rows, plan.num_scheduled_tokens, pending_index, self.block_size
            )
            decoded = self.run_decode(layout.rows, layout.positions, layout.feed_index,
                                      layout.sampling)  # fmt: skip
            if decoded is None:  # a pipeline stage before the last
                return step
            if layout.sampling is None:  # every request samples
                step.handles = handles
            else:
                step.handles = list(compress(handles, layout.samples.tolist()))
            token_ids, step.logprobs = decoded
        else:
            no_drafts = np.zeros(len(rows), np.int64)
            inputs = self.inputs.build(
                handles, plan.num_scheduled_tokens, rows, pending_index, no_drafts
            )
            model, metadata = self.model, inputs.attn_metadata
            hidden = run_stage(model, self.link, inputs.input_ids, inputs.positions, metadata)  # type: ignore[arg-type]
            if hidden is None:  # a pipeline stage before the last
                return step
            output, rows = self.sample(hidden, inputs)
            step.prompt_logprobs, step.pooled = rows.prompt_logprobs, rows.pooled
            if output is None:
                return step
            step.handles = inputs.sampling_handles
            step.logprobs = output.logprob_tensors
            token_ids = self.sampled[: len(step.handles)]
            token_ids.copy_(output.token_ids)  # the next step's fed tokens
        step.host_token_ids, step.done = self.sampled_ids.copy(token_ids, plan.step_id)
        return step

    def _pending_index(self) -> np.ndarray:
        """Per persistent-batch row: the index of its token in the step in flight, or -1.
        That token sits at position num_tokens[row], known to the device only."""
        index = self._pending_index_buffer
        index.fill(-1)
        step = self.pending
        if step is not None and step.result is None:
            row_of = self.input_batch.row_of
            for i, handle in enumerate(step.handles):
                row = row_of.get(handle)
                if row is not None:
                    index[row] = i
        return index

    def sample(
        self, hidden: torch.Tensor, inputs: StepInputs
    ) -> tuple[SamplerOutput | None, RowOutputs]:
        """The step's samples (None: no request samples), and what its other rows give (prompt
        logprobs, pooled vectors)."""
        rows = self.logits.run(hidden, inputs)
        if rows.logits is None:
            return None, rows
        metadata = self.input_batch.sampling_metadata(
            inputs.sampling_rows, inputs.sampling_positions, self.vocab_size
        )
        return self.sampler(rows.logits, metadata), rows
