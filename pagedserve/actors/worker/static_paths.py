"""The static paths of ModelRunner's steps, which replay captured CUDA graphs on a GPU: decode
steps and short chunks as rows of the decode graphs (cuda_graphs.py, static_rows.py), and a
lone request's prompt chunk through the prefill graphs (prefill_graphs.py); with the sampling
of their rows. They give no hidden states to pool: a step with a pooling request (pooling.py)
takes the general path. A part of ModelRunner (model_runner.py), kept apart for its size.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.actors.messages import StepPlan
from pagedserve.actors.worker.cuda_graphs import DecodeStep
from pagedserve.actors.worker.input_batch import InputBatch
from pagedserve.actors.worker.pipeline import StageLink
from pagedserve.actors.worker.prefill_graphs import PrefillStep, fill_chunk
from pagedserve.actors.worker.sampler import LogprobTensors, Sampler
from pagedserve.actors.worker.step_logits import StepLogits
from pagedserve.actors.worker.uploader import Uploader
from pagedserve.kernels.attention_metadata import cdiv


class StaticPaths:
    # ModelRunner's state that these paths read (set in ModelRunner.__init__ / load_model)
    decode_step: DecodeStep | None
    prefill_step: PrefillStep | None
    static_prefill: bool
    link: StageLink | None
    input_batch: InputBatch
    block_size: int
    sampled: torch.Tensor
    uploader: Uploader
    sampler: Sampler
    logits: StepLogits
    vocab_size: int

    def _is_lone_prefill(self, plan: StepPlan, rows: np.ndarray) -> bool:
        """Whether the plan is one request's chunk of 2 .. prefill_step.max_tokens tokens
        without prompt logprobs or pooling: the prefill graphs run it (prefill_graphs.py)."""
        step, batch = self.prefill_step, self.input_batch
        return (
            step is not None and len(rows) == 1
            and 1 < plan.num_scheduled_tokens[0] <= step.max_tokens
            and bool(batch.sampling.num_prompt_logprobs[rows[0]] < 0)
            and not (batch.pooling and batch.pools[rows[0]])
        )  # fmt: skip

    def run_prefill(
        self, rows: np.ndarray, positions: np.ndarray, feed_index: np.ndarray, samples: bool
    ) -> tuple[torch.Tensor, LogprobTensors | None]:
        """One request's chunk (rows: its persistent-batch row, repeated) through the prefill
        graphs; the sampled id (a view of `sampled`, empty when the chunk does not sample)."""
        step, batch = self.prefill_step, self.input_batch
        assert step is not None
        tokens, row = len(rows), int(rows[0])
        size = step.padded_size(tokens)
        host = step.buffers.staging()
        fill_chunk(host, batch.block_table_np[row], batch.token_ids[row, positions],
                   feed_index, positions, self.block_size, size)  # fmt: skip
        seq_len = int(positions[-1]) + 1
        logits = step.run(tokens, size, seq_len)
        if not samples:
            return self.sampled[:0], None
        return self._sample_rows(logits, rows[-1:], np.array([seq_len]), argmax_done=True)

    def _is_decode_step(self, plan: StepPlan, rows: np.ndarray, pending_index: np.ndarray) -> bool:
        """Whether the static decode path runs the plan (static_rows.py): a decode step (one
        token per request, every request samples) or, with `static_prefill`, any step of at
        most the path's rows without prompt logprobs; never a step with a pooling request."""
        step, batch = self.decode_step, self.input_batch
        if step is None or (batch.pooling and batch.pools[rows].any()):
            return False
        if max(plan.num_scheduled_tokens) == 1:
            known = batch.num_tokens[rows] + (pending_index >= 0)
            if (batch.num_computed_tokens[rows] + 1 >= known).all():
                return True
        return (
            self.static_prefill and self.link is None
            and sum(plan.num_scheduled_tokens) <= step.max_batch
            and bool((batch.sampling.num_prompt_logprobs[rows] < 0).all())
        )  # fmt: skip

    def run_decode(
        self,
        rows: np.ndarray,
        positions: np.ndarray,
        feed_index: np.ndarray,
        sampling: np.ndarray | None = None,
    ) -> tuple[torch.Tensor, LogprobTensors | None] | None:
        """Run one token of each of `rows` (a row may repeat: a verify step's positions, a
        prompt chunk's tokens) at `positions` through the static decode path, and sample the
        rows `sampling` (None: every row) unless they are all plain greedy (their argmax).
        feed_index: the index of the row's token in the previous step's sampled ids, or -1
        (the host's token). Returns the sampled ids, in order (a view of `sampled`), and the
        logprob tensors; None on a pipeline stage before the last."""
        step, batch, block_size = self.decode_step, self.input_batch, self.block_size
        assert step is not None
        num_rows = len(rows)
        seq_lens = positions + 1
        size = step.padded_size(num_rows)
        host = step.buffers.staging()
        host.token_ids[:num_rows] = batch.token_ids[rows, positions]
        host.feed_index[:num_rows] = feed_index
        host.positions[:num_rows] = positions
        blocks = batch.block_table_np[rows, positions // block_size]
        host.slot_mapping[:num_rows] = blocks * block_size + positions % block_size
        host.seq_lens[:num_rows] = seq_lens
        max_seq_len = int(seq_lens.max())
        width = cdiv(max_seq_len, block_size)
        host.block_tables[:num_rows, :width] = batch.block_table_np[rows, :width]
        host.pad(num_rows, size)
        logits = step.run(num_rows, size, max_seq_len, host)
        if logits is None:
            return None
        if sampling is not None:  # only these rows sample: their logits, then their ids
            logits = logits.index_select(0, self.uploader.upload([sampling])[0])
            rows, seq_lens = rows[sampling], seq_lens[sampling]
        return self._sample_rows(logits, rows, seq_lens, argmax_done=sampling is None)

    def _sample_rows(
        self, logits: torch.Tensor, rows: np.ndarray, seq_lens: np.ndarray, argmax_done: bool
    ) -> tuple[torch.Tensor, LogprobTensors | None]:
        """The static paths' samples of `rows` (one logits row each) into sampled[:rows]:
        their argmax when all are plain greedy (argmax_done: the step wrote it), else the
        sampler's tokens and logprobs."""
        batch = self.input_batch
        token_ids = self.sampled[: len(rows)]
        if batch.all_plain_greedy(rows):
            if not argmax_done:
                token_ids.copy_(logits.argmax(dim=-1))
            return token_ids, None
        metadata = batch.sampling_metadata(rows, seq_lens, self.vocab_size)
        output = self.sampler(self.logits.constrain(logits, rows), metadata)
        token_ids.copy_(output.token_ids)
        return token_ids, output.logprob_tensors
