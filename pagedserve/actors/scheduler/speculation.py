"""The scheduler's side of speculative decoding: whether a step speculates, the drafts a decode
verifies, and the counters of a request's verifies (vLLM's spec_decode metrics).

Counters cover the tokens a request got: a step's verifies (with rounds, several) may emit
tokens past its stop token, which the scheduler drops; the verify that emitted the stop counts
only its drafts up to it (all accepted: a verify's own sample comes after its accepted drafts),
and verifies after it count nothing. A verify of no drafts is not counted (as with one round:
a step with no drafts verifies nothing)."""

from __future__ import annotations

from pagedserve.actors.messages import SchedulerStats, StepResult
from pagedserve.actors.scheduler.request import Request
from pagedserve.config import EngineConfig


def speculating(config: EngineConfig, num_running: int, num_waiting: int) -> bool:
    """Whether a step speculates: disable_by_batch_size against the requests it may hold
    (those running and those waiting to be admitted, up to max_num_seqs)."""
    spec = config.speculative_config
    if spec is None:
        return False
    limit = spec.disable_by_batch_size
    return limit is None or min(num_running + num_waiting, config.max_num_seqs) <= limit


def drafts_to_verify(req: Request, n: int, budget: int, max_len: int) -> list[int]:
    """The drafts a decode of `req` verifies: its proposals, as many as the budget and the
    tokens it may still emit (after the one the step samples anyway) allow."""
    if n != 1 or not req.draft_token_ids:
        return []
    room = min(budget, max_len - req.num_tokens) - 1
    max_tokens = req.sampling.max_tokens
    if max_tokens is not None:
        room = min(room, max_tokens - req.num_output_tokens - 1)
    return req.draft_token_ids[: max(room, 0)]


def verifies_of(result: StepResult, i: int, start: int, drafts: int, emitted: int
                ) -> list[tuple[int, int]]:  # fmt: skip
    """Request i's verifies in `result`, each (drafts, tokens emitted): with rounds, from
    index `start` of the result's flat lists; else one of its plan's `drafts`."""
    if not result.num_verifies:
        return [(drafts, emitted)]
    end = start + result.num_verifies[i]
    return list(zip(result.verify_drafts[start:end], result.verify_emitted[start:end]))


def count_verifies(counters: SchedulerStats, verifies: list[tuple[int, int]], kept: int) -> None:
    """Count a request's verifies of one step up to the `kept` tokens it got from them."""
    for drafts, emitted in verifies:
        if kept <= 0:
            return
        accepted = emitted - 1
        if emitted > kept:  # cut short within its accepted drafts
            drafts = accepted = emitted = kept
        kept -= emitted
        if drafts:
            counters.spec_num_drafts += 1
            counters.spec_num_draft_tokens += drafts
            counters.spec_num_accepted_tokens += accepted
            counters.spec_num_emitted_tokens += emitted
