"""The step of speculative decoding: verify each request's drafts, keep what the target agrees
with, propose the next drafts. Run to completion (its tokens are on the host when it returns).

A request with d drafts runs 1 + d tokens: its last known token, then the drafts. The target
samples after each of them; the accepted drafts are the longest prefix equal to those samples
(speculative.py explains why that is exact), and the sample after the last accepted draft is
the request's own next token.

When every request of the step sits at its last known token (the usual decode step with
drafts), the step is a decode step of sum(1 + d) rows: row i of a request is its token at
position C + i with C + i + 1 keys, so the paged decode kernels give causal attention within
the drafts (the layer writes every row's k/v before attending) and the step replays a CUDA
graph like any decode step (the target's decode graphs go up to max_num_seqs * (1 + k) rows).
A draft model's next drafts are then queued on the device right behind it, starting from its
samples there (draft_chain.py), so the step has one device-to-host sync: the samples and the
drafts together. Otherwise (prefill chunks in the step) it takes the general path, a draft
model reads the step's tokens there (prompt logprobs of its prefill chunks too), and proposes
from the host's tokens after the step.

A step of prompt chunks with no drafts to verify (new requests, usually) runs as a plain
step, on its graphs, and proposes from the host's tokens afterwards: the general path runs
the target eagerly (a batch of 64 arriving at once ran at 0.8x of plain on the H200 when its
first steps took it). A step of prompt chunks and decodes with drafts runs in two parts, the
chunks as a plain step and the decodes as a verify, and reports one result.

Constrained requests (structured outputs) are never speculated: their proposals are dropped,
so they verify no drafts and sample one masked row each; their matchers advance here.
"""

from __future__ import annotations

import functools
from itertools import compress
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch

from pagedserve.actors.messages import StepPlan, StepResult, TokenLogprobs
from pagedserve.actors.worker.ngram_rounds import device_rounds, rounds_run_on_device
from pagedserve.actors.worker.run_ahead import rooms, runs_ahead, undrafted_rounds
from pagedserve.actors.worker.speculative import num_accepted
from pagedserve.actors.worker.step_inputs import check_plan_fits

if TYPE_CHECKING:
    from pagedserve.actors.worker.input_batch import InputBatch
    from pagedserve.actors.worker.model_runner import ModelRunner

# (the requests that sample, how many tokens each samples, the samples, their logprobs)
Samples = tuple[list[int], list[int], list[int], list[TokenLogprobs | None] | None]


def speculative_step(runner: ModelRunner, plan: StepPlan) -> StepResult:
    batch = runner.input_batch
    if not plan.scheduled:
        return StepResult(step_id=plan.step_id, handles=[], sampled_token_ids=[])
    rows = np.fromiter((batch.row_of[h] for h in plan.scheduled), np.int64)
    num_drafts = _num_drafts(plan, rows)
    if not num_drafts.any() and not _decode_shaped(
        runner, plan.num_scheduled_tokens, rows, num_drafts
    ):
        return _plain_then_propose(runner, plan)
    prompts = _prompt_chunks(batch, plan.num_scheduled_tokens, rows, num_drafts)
    if prompts.any():  # and decodes with drafts: each part on its own fast path
        plain = _plain_then_propose(runner, _part(plan, prompts))
        return _joined(plain, _speculate(runner, _part(plan, ~prompts), rows[~prompts]))
    return _speculate(runner, plan, rows)


def _speculate(runner: ModelRunner, plan: StepPlan, rows: np.ndarray) -> StepResult:
    """The verify (and rounds) of `plan`, a draft model's KV caught up first."""
    batch, proposer = runner.input_batch, runner.proposer
    assert proposer is not None
    coverage = proposer.coverage
    if coverage is None:
        return _rounds(runner, plan, rows)
    coverage.catch_up(runner.inputs, proposer.observe, plan.scheduled, rows)
    result = _rounds(runner, plan, rows)
    coverage.covered(batch, rows)
    return result


def _num_drafts(plan: StepPlan, rows: np.ndarray) -> np.ndarray:
    drafts = plan.spec_token_ids or [[]] * len(rows)
    return np.fromiter(map(len, drafts), np.int64, len(rows))


def _prompt_chunks(
    batch: InputBatch, num_scheduled: list[int], rows: np.ndarray, num_drafts: np.ndarray
) -> np.ndarray:
    """Per scheduled request: whether it runs more than its last known token and its drafts
    (a prompt chunk, which has no drafts)."""
    one_each = np.asarray(num_scheduled) == 1 + num_drafts
    at_last_token = batch.num_computed_tokens[rows] == batch.num_tokens[rows] - 1
    return ~(one_each & at_last_token)


def _part(plan: StepPlan, keep: np.ndarray) -> StepPlan:
    """The plan's requests where `keep`, with their tokens and drafts."""

    selectors = keep.tolist()

    def pick(values: list) -> list:
        return list(compress(values, selectors))

    return msgspec.structs.replace(
        plan, scheduled=pick(plan.scheduled), num_scheduled_tokens=pick(plan.num_scheduled_tokens),
        spec_token_ids=pick(plan.spec_token_ids),
    )  # fmt: skip


def _joined(plain: StepResult, spec: StepResult) -> StepResult:
    """One result of a step's two parts: the plain part's requests (a token each, from one
    verify of no drafts), then the speculative part's."""
    n, m = len(plain.handles), len(spec.handles)
    joined = StepResult(
        step_id=spec.step_id, handles=plain.handles + spec.handles,
        sampled_token_ids=plain.sampled_token_ids + spec.sampled_token_ids,
        num_sampled=[1] * n + (spec.num_sampled or [1] * m),
        draft_token_ids=(plain.draft_token_ids or [[]] * n) + (spec.draft_token_ids or [[]] * m),
        prompt_logprobs=plain.prompt_logprobs + spec.prompt_logprobs,
        grammar_done=plain.grammar_done + spec.grammar_done,
    )  # fmt: skip
    if spec.num_verifies:
        joined.num_verifies = [1] * n + spec.num_verifies
        joined.verify_drafts = [0] * n + spec.verify_drafts
        joined.verify_emitted = [1] * n + spec.verify_emitted
    if plain.logprobs is not None or spec.logprobs is not None:
        joined.logprobs = (plain.logprobs or [None] * n) + (
            spec.logprobs or [None] * len(spec.sampled_token_ids)
        )
    return joined


def _plain_then_propose(runner: ModelRunner, plan: StepPlan) -> StepResult:
    """A step of prompt chunks that verifies no drafts: the plain step's path (its graphs;
    the general path would run the target eagerly), then proposals from the host's tokens,
    a draft model catching up on them first."""
    batch, proposer = runner.input_batch, runner.proposer
    assert proposer is not None
    runner.pending = runner.launch_plain(plan)
    result = runner.finish()
    assert result is not None
    if not (plan.propose and result.handles):
        return result
    rows = np.fromiter((batch.row_of[h] for h in result.handles), np.int64)
    coverage = proposer.coverage
    if coverage is not None:
        coverage.catch_up(runner.inputs, proposer.observe, result.handles, rows)
    proposals = proposer.propose(batch, rows)
    if coverage is not None:
        coverage.covered(batch, rows)
    result.draft_token_ids = runner.structured.without_drafts(rows, proposals)
    return result


def _rounds(runner: ModelRunner, plan: StepPlan, rows: np.ndarray) -> StepResult:
    """The step's verify, and with num_rounds further verifies of its own proposals."""
    num_scheduled = plan.num_scheduled_tokens
    decode_shaped = _decode_shaped(runner, num_scheduled, rows, _num_drafts(plan, rows))
    if decode_shaped and rounds_run_on_device(runner, plan, rows):
        return device_rounds(runner, plan, rows)
    batch = runner.input_batch
    drafts = plan.spec_token_ids or [[] for _ in plan.scheduled]
    spec = runner.config.speculative_config
    if spec is None or spec.num_rounds == 1 or not (decode_shaped and plan.propose):
        return _round(runner, plan, num_scheduled, rows, drafts, decode_shaped)
    if runner.structured.constrains(rows):  # a grammar may complete within a round
        return _round(runner, plan, num_scheduled, rows, drafts, decode_shaped)
    rounds: list[StepResult] = []
    verified: list[list[list[int]]] = []
    while True:
        if not any(drafts) and runs_ahead(runner, rows):
            finish = functools.partial(_undrafted_result, runner, plan)
            done = undrafted_rounds(runner, rows, spec.num_rounds - len(rounds), finish)
        else:
            done = [_round(runner, plan, num_scheduled, rows, drafts, decode_shaped=True)]
        rounds += done
        verified += [drafts] * len(done)  # drafts past the first are none
        if len(rounds) >= spec.num_rounds:
            break
        proposals = _within_room(runner, rows, rounds[-1].draft_token_ids)
        if proposals is None:
            break
        num_scheduled = [1 + len(p) for p in proposals]
        if not _decode_shaped(runner, num_scheduled, rows, np.asarray(num_scheduled) - 1):
            break
        for row, proposed in zip(rows.tolist(), proposals):
            batch.write_drafts(row, proposed)
        drafts = proposals
    return _merged(rounds, verified)


def _round(
    runner: ModelRunner,
    plan: StepPlan,
    num_scheduled: list[int],
    rows: np.ndarray,
    drafts: list[list[int]],
    decode_shaped: bool,
) -> StepResult:
    """One verify of `drafts` (per scheduled request, num_scheduled tokens each; as a decode
    step where `decode_shaped`, see _decode_shaped) and the next proposals."""
    result = StepResult(step_id=plan.step_id, handles=[], sampled_token_ids=[])
    num_drafts = np.array([len(d) for d in drafts], np.int64)
    proposals = None  # computed on the device with the verify (a draft model's chain)
    if decode_shaped:
        samples, proposals = _verify_as_decode(runner, plan, rows, num_drafts)
    else:
        samples = _verify_general(runner, plan, rows, num_drafts, result)
    return _finished(runner, plan, result, samples, drafts, proposals)


def _finished(
    runner: ModelRunner,
    plan: StepPlan,
    result: StepResult,
    samples: Samples,
    drafts: list[list[int]],
    proposals: list[list[int]] | None,
) -> StepResult:
    """The round's result: its samples accepted, and the next proposals (`proposals`, or the
    proposer's from the host's tokens)."""
    batch = runner.input_batch
    _accept(runner, result, samples, dict(zip(plan.scheduled, drafts)))
    if plan.propose and result.handles:
        assert runner.proposer is not None
        sampling_rows = np.fromiter((batch.row_of[h] for h in result.handles), np.int64)
        if proposals is None:
            proposals = runner.proposer.propose(batch, sampling_rows)
        result.draft_token_ids = runner.structured.without_drafts(sampling_rows, proposals)
    return result


def _undrafted_result(runner: ModelRunner, plan: StepPlan, sampled: list[int]) -> StepResult:
    """A round that verified no drafts: its one token a request, and the next proposals."""
    result = StepResult(step_id=plan.step_id, handles=[], sampled_token_ids=[])
    samples = (list(plan.scheduled), [1] * len(sampled), sampled, None)
    return _finished(runner, plan, result, samples, [[] for _ in sampled], None)


def _within_room(
    runner: ModelRunner, rows: np.ndarray, proposals: list[list[int]]
) -> list[list[int]] | None:
    """The proposals of another round, cut to each request's room (run_ahead.rooms): a round
    emits at most 1 + drafts tokens; None when some request has no room for its next token."""
    room = rooms(runner, rows)
    if (room < 0).any():
        return None
    return [proposed[: int(r)] for proposed, r in zip(proposals, room)]


def _merged(rounds: list[StepResult], drafts: list[list[list[int]]]) -> StepResult:
    """One result of several rounds (every request samples in each, in the same order): each
    request's tokens and logprobs round after round, each verify's drafts and emitted count,
    and the last round's proposals."""
    first, last = rounds[0], rounds[-1]
    merged = StepResult(step_id=first.step_id, handles=first.handles, sampled_token_ids=[],
                        draft_token_ids=last.draft_token_ids)  # fmt: skip
    merged.logprobs = None if first.logprobs is None else []
    offsets = [0] * len(rounds)
    for i in range(len(first.handles)):
        for r, result in enumerate(rounds):
            count, start = result.num_sampled[i], offsets[r]
            merged.sampled_token_ids += result.sampled_token_ids[start : start + count]
            if merged.logprobs is not None and result.logprobs is not None:
                merged.logprobs += result.logprobs[start : start + count]
            offsets[r] += count
            merged.verify_drafts.append(len(drafts[r][i]))
            merged.verify_emitted.append(count)
        merged.num_sampled.append(sum(result.num_sampled[i] for result in rounds))
        merged.num_verifies.append(len(rounds))
    return merged


def _decode_shaped(
    runner: ModelRunner, num_scheduled: list[int], rows: np.ndarray, num_drafts: np.ndarray
) -> bool:
    """Every request runs its last known token and its drafts, within the decode graphs."""
    step = runner.decode_step
    if step is None or int((1 + num_drafts).sum()) > step.max_batch:
        return False
    return not _prompt_chunks(runner.input_batch, num_scheduled, rows, num_drafts).any()


def _verify_as_decode(
    runner: ModelRunner, plan: StepPlan, rows: np.ndarray, num_drafts: np.ndarray
) -> tuple[Samples, list[list[int]] | None]:
    """The verify as one decode step (a graph replay), and a proposer that can start from
    its samples on the device queued right behind it: one device-to-host sync for both."""
    batch, proposer = runner.input_batch, runner.proposer
    assert proposer is not None and runner.decode_step is not None
    counts = 1 + num_drafts
    total = int(counts.sum())
    within = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    computed = batch.num_computed_tokens[rows]
    positions = np.repeat(computed, counts) + within
    expanded = np.repeat(rows, counts)
    known = np.repeat(batch.num_tokens[rows] + num_drafts, counts)
    check_plan_fits(batch, expanded, positions + 1, known, runner.block_size)
    batch.num_computed_tokens[rows] = computed + counts
    decoded = runner.run_decode(expanded, positions, np.full(total, -1, np.int64))
    assert decoded is not None, "speculative decoding runs without pipeline stages"
    tokens, logprobs = decoded
    proposed = None
    if plan.propose:
        starts = np.cumsum(counts) - counts  # each request's first verify row
        proposed = proposer.propose_after_verify(
            runner.decode_step, batch, rows, starts, num_drafts
        )
    if proposed is None:
        sampled, proposals = tokens.tolist(), None
    else:  # one transfer for both
        flat = torch.cat([tokens, proposed.flatten()]).tolist()
        sampled, k = flat[:total], proposed.shape[1]
        proposals = [flat[total + i * k : total + (i + 1) * k] for i in range(len(rows))]
    as_list = None if logprobs is None else logprobs.to_list()
    return (list(plan.scheduled), counts.tolist(), sampled, as_list), proposals


def _verify_general(
    runner: ModelRunner,
    plan: StepPlan,
    rows: np.ndarray,
    num_drafts: np.ndarray,
    result: StepResult,
) -> Samples:
    assert runner.model is not None and runner.proposer is not None
    no_pending = np.full(len(rows), -1, np.int64)
    inputs = runner.inputs.build(
        plan.scheduled, plan.num_scheduled_tokens, rows, no_pending, num_drafts
    )
    hidden = runner.model(inputs.input_ids, inputs.positions, inputs.attn_metadata)
    runner.proposer.observe(inputs)
    output, rows = runner.sample(hidden, inputs)
    if rows.prompt_logprobs is not None:
        result.prompt_logprobs = rows.prompt_logprobs.to_wire()
    if output is None:
        return [], [], [], None
    counts = inputs.sampling_counts.tolist()
    return inputs.sampling_handles, counts, output.token_ids.tolist(), output.logprobs


def _accept(
    runner: ModelRunner, result: StepResult, samples: Samples, drafts: dict[int, list[int]]
) -> None:
    """Each sampling request's tokens (accepted drafts, then the target's own) into the
    persistent batch and the result; the KV of rejected drafts rolled back."""
    batch = runner.input_batch
    handles, counts, sampled, logprobs = samples
    result.handles = handles
    result.logprobs = [] if logprobs is not None else None
    start = 0
    for handle, count in zip(handles, counts):
        own = sampled[start : start + count]
        accepted = num_accepted(drafts[handle], own)
        row = batch.row_of[handle]
        batch.append_tokens(row, own[: accepted + 1])
        batch.num_computed_tokens[row] -= len(drafts[handle]) - accepted
        result.sampled_token_ids += own[: accepted + 1]
        result.num_sampled.append(accepted + 1)
        if runner.structured.accept(row, own[: accepted + 1]):
            result.grammar_done.append(handle)
        if logprobs is not None:
            result.logprobs += logprobs[start : start + accepted + 1]  # type: ignore[operator]
        start += count
