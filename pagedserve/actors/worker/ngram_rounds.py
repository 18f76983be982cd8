"""A step's rounds of n-gram speculation on the device, with one device-to-host sync.

With rounds (SpeculativeConfig.num_rounds > 1) the worker verifies its own next proposals again
before it reports (verify_step.py). With the host's lookup every round ends in a sync: the host
reads the round's tokens, looks the next drafts up, and launches the next verify, so the device
idles through the host's part of each round. For plain greedy requests (their token is the
argmax the decode graph writes into `sampled`) the rounds can stay on the device: each round is
one kernel that accepts the last verify's samples, looks the next drafts up in the request's
tokens there and writes the verify's rows into the decode step's input buffers
(kernels/triton_ngram.py), then a replay of the decode graph. The host queues every round,
then reads every round's drafts, samples and emitted count in one copy.

Opt-in (SpeculativeConfig.rounds_on_device): on an H100 with the ~94M target and copy prompts
(n-gram k=8, 8 rounds, acceptance 0.67) it gave 0.312 and 0.369 ms per token in two engines
against the host's loop's 0.331 and 0.271: no gain beyond the spread between engines
(scripts/results/session23_h100.md). A device round verifies 1 + k rows whatever its drafts
(wider than the host's verifies where drafts run short), which offsets the syncs saved.

The tokens are those of the host's loop: each round verifies the drafts the host's lookup
(NgramProposer.lookup) would propose, cut to the request's room (KV slots held, max_tokens, the
model's length); a request without room verifies nothing in the rounds left (the host's loop
stops them all), and the scheduler drops whatever follows a stop, as it does for the host's
rounds. The next step's proposals come from the host's lookup on the step's tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedserve.actors.messages import StepPlan, StepResult
from pagedserve.actors.worker.decode_buffers import DecodeFields
from pagedserve.actors.worker.speculative import NgramProposer
from pagedserve.actors.worker.step_inputs import check_plan_fits
from pagedserve.kernels.triton_ngram import Phases, RoundsState, RowFields, advance

if TYPE_CHECKING:
    from pagedserve.actors.worker.model_runner import ModelRunner


def rounds_run_on_device(runner: ModelRunner, plan: StepPlan, rows: np.ndarray) -> bool:
    """Whether `plan`, a decode-shaped verify step, runs its rounds on the device: n-gram
    drafts, rounds (rounds_on_device), plain greedy requests, every request with drafts to
    verify, and a decode step that replays graphs (or runs on the CPU, where its input
    buffers are host memory).

    Every request drafting: a device round verifies 1 + k rows whatever its drafts, and past
    small_batch_gemm_rows rows (1 by default) the linear layers leave the Triton GEMV for
    cuBLAS (models/linear.py), so a round without drafts cost about twice a decode step (H100,
    the ~94M target). Requests that found a match at the step's start tend to keep matching (a
    copied span); the others take the host's loop, whose verifies are as wide as their
    drafts."""
    spec, step = runner.config.speculative_config, runner.decode_step
    return (
        spec is not None and spec.rounds_on_device and spec.num_rounds > 1 and plan.propose
        and isinstance(runner.proposer, NgramProposer)
        and step is not None and (bool(step.graphs) or runner.device.type == "cpu")
        and every_request_drafts(plan, rows) and runner.input_batch.all_plain_greedy(rows)
    )  # fmt: skip


def every_request_drafts(plan: StepPlan, rows: np.ndarray) -> bool:
    return len(plan.spec_token_ids) == len(rows) and all(plan.spec_token_ids)


def device_rounds(runner: ModelRunner, plan: StepPlan, rows: np.ndarray) -> StepResult:
    """The step's num_rounds verifies (the first of the plan's drafts) on the device."""
    spec, step, batch = runner.config.speculative_config, runner.decode_step, runner.input_batch
    proposer = runner.proposer
    assert spec is not None and step is not None and isinstance(proposer, NgramProposer)
    k, num_rounds, block_size = spec.num_speculative_tokens, spec.num_rounds, runner.block_size
    width = 1 + k
    verify_rows = len(rows) * width
    size = step.padded_size(verify_rows)
    drafts = plan.spec_token_ids or [[] for _ in rows]
    _check_first_verify(runner, rows, drafts)
    state = _upload_state(runner, rows, drafts, k, num_rounds)
    _prepare_buffers(step.buffers.tensors, state.tables, width, verify_rows, size)
    fields = step.buffers.tensors
    row_fields = RowFields(fields.token_ids, fields.positions, fields.slot_mapping, fields.seq_lens)
    host = step.buffers.host_aliases()
    max_seq_len = int(batch.num_tokens[rows].max()) + num_rounds * width
    samples = runner.sampled[:verify_rows]
    stats = torch.empty(num_rounds, len(rows), k + 3, dtype=torch.int64, device=runner.device)
    lookup = (proposer.min_n, proposer.max_n)
    advance(state, Phases(rows=row_fields), block_size)  # the plan's drafts
    step.replay(size, max_seq_len, host)
    for r in range(1, num_rounds):
        advance(state, Phases(samples, stats[r - 1], row_fields, lookup), block_size)
        step.replay(size, max_seq_len, host)
    advance(state, Phases(samples, stats[-1]), block_size)
    return _result(runner, plan, rows, stats.cpu().numpy())


def _check_first_verify(runner: ModelRunner, rows: np.ndarray, drafts: list[list[int]]) -> None:
    """The plan's verify fits the requests' blocks (as verify_step's decode path checks)."""
    batch = runner.input_batch
    counts = 1 + np.fromiter(map(len, drafts), np.int64, len(rows))
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    positions = np.repeat(batch.num_computed_tokens[rows], counts) + within
    known = np.repeat(batch.num_tokens[rows] + counts - 1, counts)
    check_plan_fits(batch, np.repeat(rows, counts), positions + 1, known, runner.block_size)


def _upload_state(
    runner: ModelRunner, rows: np.ndarray, drafts: list[list[int]], k: int, num_rounds: int
) -> RoundsState:
    """The rounds' state of `rows` on the device, in one copy: tokens (with room for every
    token the rounds may add), counts, room, block tables and the plan's drafts."""
    batch, max_len = runner.input_batch, runner.config.max_model_len
    assert max_len is not None
    num_tokens = batch.num_tokens[rows]
    width = int(batch.num_blocks[rows].max())
    columns = int(num_tokens.max()) + num_rounds * (1 + k) + 1
    count = len(rows)
    sizes = [count * columns, count, count, count, count * k, count * width]
    packed = np.zeros(sum(sizes), np.int64)
    tokens, n, room_end, num_drafts, plan_drafts, tables = np.split(packed, np.cumsum(sizes)[:-1])
    known = min(columns, batch.token_capacity)
    tokens.reshape(count, columns)[:, :known] = batch.token_ids[rows, :known]
    n[:] = num_tokens
    capacity = batch.num_blocks[rows] * runner.block_size
    room_end[:] = np.minimum(capacity, np.minimum(batch.length_limit[rows], max_len) - 1)
    num_drafts[:] = [len(d) for d in drafts]
    for i, proposed in enumerate(drafts):
        plan_drafts[i * k : i * k + len(proposed)] = proposed
    tables.reshape(count, width)[:] = batch.block_table_np[rows, :width]
    device = _to_device(packed, runner.device)
    parts = torch.split(device, sizes)
    return RoundsState(
        tokens=parts[0].view(count, columns), num_tokens=parts[1], room_end=parts[2],
        tables=parts[5].view(count, width).to(torch.int32), drafts=parts[4].view(count, k),
        num_drafts=parts[3],
    )  # fmt: skip


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def _prepare_buffers(
    fields: DecodeFields[torch.Tensor], tables: torch.Tensor, width: int, verify_rows: int,
    size: int,
) -> None:  # fmt: skip
    """What stays the same through the step's rounds: no row fed from `sampled`, each verify
    row's block table, the padded rows past the verify rows."""
    fields.feed_index[:size] = -1
    fields.block_tables[:verify_rows, : tables.shape[1]] = tables.repeat_interleave(width, 0)
    fields.token_ids[verify_rows:size] = 0
    fields.positions[verify_rows:size] = 0
    fields.slot_mapping[verify_rows:size] = -1
    fields.seq_lens[verify_rows:size] = 1


def _result(runner: ModelRunner, plan: StepPlan, rows: np.ndarray, stats: np.ndarray) -> StepResult:
    """The step's result from every round's (drafts, emitted, samples) per request, the
    requests' tokens appended to the persistent batch, and the next step's proposals."""
    batch, proposer = runner.input_batch, runner.proposer
    assert proposer is not None
    result = StepResult(step_id=plan.step_id, handles=list(plan.scheduled), sampled_token_ids=[])
    for i, row in enumerate(rows.tolist()):
        verifies = stats[:, i][stats[:, i, 0] >= 0]  # the rounds it verified in
        tokens = [t for v in verifies.tolist() for t in v[2 : 2 + v[1]]]
        batch.append_tokens(row, tokens)
        batch.num_computed_tokens[row] += len(tokens)
        result.sampled_token_ids += tokens
        result.num_sampled.append(len(tokens))
        result.num_verifies.append(len(verifies))
        result.verify_drafts += verifies[:, 0].tolist()
        result.verify_emitted += verifies[:, 1].tolist()
    proposals = proposer.propose(batch, rows)
    result.draft_token_ids = runner.structured.without_drafts(rows, proposals)
    return result
