"""Beam search, as vLLM's `LLM.beam_search` and the API's `use_beam_search` do it: from the
client's side, over ordinary engine requests.

Each step asks the engine for one token of every live beam (the beam's prompt and output so far
as a prompt of token ids, `max_tokens` 1), with the logprobs of the 2 x beam_width most likely
next tokens; the prefix cache makes such a prompt cost about one new token's prefill. A beam's
candidates are those tokens (and the one the step sampled), each scored

    score = cumulative logprob / length ** length_penalty

(vLLM's rule, after transformers': the length counts the prompt and the output, without a final
EOS). A candidate ending in an EOS token (unless ignore_eos) is complete; the beam_width best of
the others live on. The search ends when no beam lives, after max_tokens steps or when the beams
fill max_model_len; the answer is the beam_width best of the complete and live beams, best first.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from pagedserve.actors.messages import (
    FinishReason,
    PromptOptions,
    RequestDelta,
    SamplingParams,
    TokenLogprobs,
)
from pagedserve.api.client import AsyncClient
from pagedserve.api.generation import Choice, Event, Job, open_choices
from pagedserve.outputs import Logprob, logprob_dict

MAX_LENGTH_PENALTY = 10.0
Candidates = dict[int, Logprob]  # a step's next tokens (vLLM's per-token logprobs shape)


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # keep a final EOS's text in the beam's text

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(
                f"max_tokens must be at least 1 for beam search, got {self.max_tokens}"
            )
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and non-negative, got {self.temperature}")
        if not abs(self.length_penalty) <= MAX_LENGTH_PENALTY:  # length ** it stays finite
            raise ValueError(
                f"length_penalty must be within +-{MAX_LENGTH_PENALTY}, got {self.length_penalty}"
            )

    def step_sampling(self, top_logprobs: int = 0, seed: int | None = None) -> SamplingParams:
        """One step's engine request: a token and its 2 x beam_width (or more) alternatives."""
        return SamplingParams(
            max_tokens=1,
            temperature=self.temperature,
            logprobs=max(2 * self.beam_width, top_logprobs),
            ignore_eos=True,
            seed=seed,
        )


@dataclass
class BeamSearchSequence:
    """vLLM's: one beam, its tokens counting the prompt's."""

    tokens: list[int]
    logprobs: list[Candidates] = field(default_factory=list)  # per output token: its step's
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an EOS) or "length"
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


class BeamSearch:
    """One prompt's search: `live` are the beams the next step extends, in this order."""

    def __init__(
        self, params: BeamSearchParams, eos_token_ids: Iterable[int], max_model_len: int
    ) -> None:
        self.params = params
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.prompt_len = 0
        self.steps = 0
        self.live: list[BeamSearchSequence] = []
        self.complete: list[BeamSearchSequence] = []

    @property
    def done(self) -> bool:
        return not self.live

    def start(self, prompt_token_ids: list[int], first: Candidates) -> None:
        """The first step, taken by the engine from the original prompt (text, messages or
        ids): the prompt's tokens and its next tokens."""
        self.prompt_len = len(prompt_token_ids)
        self.live = [BeamSearchSequence(list(prompt_token_ids))]
        self.advance([first])

    def advance(self, steps: list[Candidates]) -> None:
        """Each live beam's next tokens, in the order of `live`."""
        children = []
        for beam, candidates in zip(self.live, steps, strict=True):
            for token_id, logprob in candidates.items():
                child = BeamSearchSequence(
                    beam.tokens + [token_id],
                    beam.logprobs + [candidates],
                    beam.cum_logprob + logprob.logprob,
                )
                if token_id in self.eos and not self.params.ignore_eos:
                    child.finish_reason = FinishReason.STOP.openai_name
                    self.complete.append(child)
                else:
                    children.append(child)
        children.sort(key=self.score, reverse=True)
        self.live = children[: self.params.beam_width]
        self.steps += 1
        full = bool(self.live) and len(self.live[0].tokens) >= self.max_model_len
        if self.steps >= self.params.max_tokens or full:
            for beam in self.live:
                beam.finish_reason = FinishReason.LENGTH.openai_name
            self.complete += self.live
            self.live = []

    def best(self) -> list[BeamSearchSequence]:
        return sorted(self.complete, key=self.score, reverse=True)[: self.params.beam_width]

    def score(self, beam: BeamSearchSequence) -> float:
        length = len(beam.tokens) - (beam.tokens[-1] in self.eos)
        return beam.cum_logprob / length**self.params.length_penalty

    def output_ids(self, beam: BeamSearchSequence) -> list[int]:
        return beam.tokens[self.prompt_len :]

    def text_ids(self, beam: BeamSearchSequence) -> list[int]:
        """The output tokens the beam's text shows: a final EOS only when asked for."""
        ids = self.output_ids(beam)
        ended = beam.finish_reason == FinishReason.STOP.openai_name
        return ids[:-1] if ended and not self.params.include_stop_str_in_output else ids


def chosen_logprobs(
    beam: BeamSearchSequence, output_ids: list[int], top: int
) -> list[TokenLogprobs]:
    """A beam's output tokens as the API's logprobs: each token's logprob and rank in its
    step, and that step's `top` most likely tokens."""
    entries = []
    for token_id, candidates in zip(output_ids, beam.logprobs):
        ranked = sorted(
            (lp.rank, tid, lp.logprob) for tid, lp in candidates.items() if lp.rank is not None
        )[:top]
        own = candidates[token_id]
        entries.append(
            TokenLogprobs(
                token_id,
                own.logprob,
                own.rank or 0,
                [tid for _, tid, _ in ranked],
                [lp for _, _, lp in ranked],
            )
        )
    return entries


@dataclass(frozen=True)
class BeamEngineFacts:
    """What a beam search through the server needs besides its parameters."""

    eos_token_ids: list[int]
    max_model_len: int
    text_of: Callable[[list[int]], str]
    top_logprobs: int | None  # the logprobs the answer shows a token (None: none)


@asynccontextmanager
async def open_beams(
    client: AsyncClient,
    jobs: list[Job],
    params: BeamSearchParams,
    engine: BeamEngineFacts,
) -> AsyncIterator[AsyncIterator[Event]]:
    """An API call's beam search (`jobs`: beam_width choices a prompt, as `plan_jobs` numbers
    them), run to its end, then its answer as events: choice prompt x beam_width + rank is
    that prompt's beam of that rank, in one whole delta."""
    roots = jobs[:: params.beam_width]
    step = params.step_sampling(engine.top_logprobs or 0, roots[0].sampling.seed)
    searches = [BeamSearch(params, engine.eos_token_ids, engine.max_model_len) for _ in roots]
    first = [
        Job(i, job.prompt, step, job.options, job.priority, job.lora) for i, job in enumerate(roots)
    ]
    for search, choice in zip(searches, await _step(client, first)):
        search.start(choice.prompt_token_ids, _candidates(choice))
    while live := [search for search in searches if not search.done]:
        beams = [beam for search in live for beam in search.live]
        priority, lora = roots[0].priority, roots[0].lora
        requests = [
            Job(i, list(beam.tokens), step, PromptOptions(), priority, lora)
            for i, beam in enumerate(beams)
        ]
        choices = iter(await _step(client, requests))
        for search in live:
            search.advance([_candidates(next(choices)) for _ in search.live])
    yield _answer(searches, params.beam_width, engine)


async def _step(client: AsyncClient, jobs: list[Job]) -> list[Choice]:
    """One step's engine requests, run to their end."""
    choices = [Choice(job.index) for job in jobs]
    async with open_choices(client, jobs) as events:
        async for index, delta in events:
            choices[index].add(delta)
    return choices


def _candidates(choice: Choice) -> Candidates:
    assert choice.logprobs, "a beam search step asks for logprobs"
    return logprob_dict(choice.logprobs[0])


async def _answer(
    searches: list[BeamSearch], beam_width: int, engine: BeamEngineFacts
) -> AsyncIterator[Event]:
    for p_index, search in enumerate(searches):
        for rank, beam in enumerate(search.best()):
            ids = search.output_ids(beam)
            logprobs = None
            if engine.top_logprobs is not None:
                logprobs = chosen_logprobs(beam, ids, engine.top_logprobs)
            finish = FinishReason.STOP if beam.finish_reason == "stop" else FinishReason.LENGTH
            yield (
                p_index * beam_width + rank,
                RequestDelta(
                    seq=0,
                    text=engine.text_of(search.text_ids(beam)),
                    token_ids=ids,
                    logprobs=logprobs,
                    finish_reason=finish,
                    prompt_token_ids=beam.tokens[: search.prompt_len],
                ),
            )
