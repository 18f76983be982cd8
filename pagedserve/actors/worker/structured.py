"""Constrained decoding in the worker: a grammar matcher per constrained request, and each
step's token masks (SamplingParams.structured_outputs; grammars from actors/grammars.py).

Matchers are part of the worker's cache of a request, like its tokens: one per persistent-batch
row, built when the request arrives (new, or resumed after preemption) by copying a compiled
grammar and feeding it the request's output tokens so far, then advanced with every token the
worker appends (`accept`). Grammars are compiled in a background thread, at most one compile
per grammar text (`GrammarCache`): a request's grammar compiles while its first step's forward
pass runs, and the matcher is taken when its mask is needed.

Masks: one bit per vocabulary entry (llguidance's int32 words), computed on the host for the
constrained rows of a step once the step before it has finished (the runner launches the
forward first, so the host computes while the device runs), uploaded in one copy with their
row indices, and applied to the logits before the sampler (`apply_token_bitmask`: disallowed
logits become -inf).

Speculative decoding: constrained requests are not speculated. The worker drops the proposals
for them (`without_drafts`), so a verify step samples one masked row for each, like any step.

The grammar's end ends the request: `accept` reports when a matcher has stopped (no more
tokens but EOS can follow), and the scheduler finishes the request with "stop".
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedserve.actors.chat import eos_token_ids
from pagedserve.actors.grammars import grammar_text, load_ll_tokenizer
from pagedserve.actors.messages import StructuredOutputsParams
from pagedserve.actors.worker.uploader import Uploader
from pagedserve.config import EngineConfig

if TYPE_CHECKING:
    import llguidance

logger = logging.getLogger(__name__)

GRAMMAR_CACHE_SIZE = 64  # compiled grammars kept per worker
MASK_THREADS = 2  # llguidance's threads computing a step's masks
GRAMMAR_COMPILE_TIMEOUT_S = 10  # the longest a step waits for a request's grammar


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [n, V], bitmask [n, >= ceil(V / 32)] int32 (bit j of word w: token 32 w + j is
    allowed) -> the logits with every disallowed token at -inf (a new tensor)."""
    n, vocab = logits.shape
    if bitmask.shape[0] != n or bitmask.shape[1] * 32 < vocab or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not fit logits {(n, vocab)}")
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(n, -1)[:, :vocab]
    return logits.masked_fill(~allowed, float("-inf"))


class GrammarCache:
    """Compiled grammars (llguidance matchers in their start state), by grammar text: the
    first request for a grammar starts its compile in a background thread; later ones share
    it. Requests copy the compiled matcher (cheap)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer) -> None:
        self.tokenizer = tokenizer
        self.compiled: OrderedDict[str, Future[llguidance.LLMatcher]] = OrderedDict()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")

    def get(self, params: StructuredOutputsParams) -> Future[llguidance.LLMatcher]:
        try:
            text = grammar_text(params)
        except ValueError as exc:  # refused by the tokenizer actor: never reached in practice
            text = f"invalid grammar: {exc}"  # compiles to a matcher in its error state
        future = self.compiled.get(text)
        if future is None:
            future = self.pool.submit(self._compile, text)
            self.compiled[text] = future
            if len(self.compiled) > GRAMMAR_CACHE_SIZE:
                self.compiled.popitem(last=False)
        self.compiled.move_to_end(text)
        return future

    def _compile(self, text: str) -> llguidance.LLMatcher:
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            logger.warning("a grammar failed to compile: %s", matcher.get_error())
        return matcher

    def error_matcher(self, reason: str) -> llguidance.LLMatcher:
        """A matcher in its error state: stopped, its mask allows EOS only."""
        return self._compile(f"invalid grammar: {reason}")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class StructuredOutputs:
    """The matchers of a worker's constrained requests, by persistent-batch row."""

    def __init__(self, config: EngineConfig, vocab_size: int, device: torch.device) -> None:
        self.config, self.vocab_size, self.device = config, vocab_size, device
        self.words = 0  # int32 words of a mask: the llguidance tokenizer's vocabulary / 32
        self.cache: GrammarCache | None = None  # built with the first constrained request
        self.executor: llguidance.LLExecutor | None = None
        self.matchers: dict[int, llguidance.LLMatcher] = {}
        # requests whose grammar is still compiling: the future and the tokens to feed it
        self.compiling: dict[int, tuple[Future[llguidance.LLMatcher], list[int]]] = {}
        self.uploader: Uploader | None = None  # its own staging: the step inputs keep theirs

    def add(self, row: int, params: StructuredOutputsParams | None, output_ids: list[int]) -> None:
        """A request arrives at `row` (new, or resumed with its output so far)."""
        self.remove(row)
        if params is not None:
            self.compiling[row] = (self._cache().get(params), output_ids)

    def remove(self, row: int) -> None:
        self.matchers.pop(row, None)
        self.compiling.pop(row, None)

    def constrains(self, rows: np.ndarray) -> bool:
        if not (self.matchers or self.compiling):
            return False
        return any(row in self.matchers or row in self.compiling for row in rows.tolist())

    def accept(self, row: int, token_ids: list[int]) -> bool:
        """Feed a request's new tokens to its matcher (rows without one: nothing); whether its
        grammar is complete (no token but EOS may follow; an error state stops it too)."""
        matcher = self._matcher(row)
        if matcher is None:
            return False
        for token in token_ids:
            if matcher.is_stopped():
                break
            matcher.consume_token(token)
        return matcher.is_stopped()

    def accept_sampled(self, handles: list[int], rows: list[int], tokens: np.ndarray) -> list[int]:
        """Feed each request its sampled token (rows -1: dropped meanwhile); the handles whose
        grammar these tokens complete."""
        if not (self.matchers or self.compiling):
            return []
        return [
            handle
            for handle, row, token in zip(handles, rows, tokens.tolist())
            if row >= 0 and self.accept(row, [token])
        ]

    def apply(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """Mask the logits of a step's sampling rows (`rows`: each logits row's persistent-batch
        row; a constrained request has one, as it is never speculated)."""
        jobs, indices = [], []
        for index, row in enumerate(rows.tolist()):
            matcher = self._matcher(row)
            if matcher is not None:
                jobs.append((matcher, len(indices)))
                indices.append(index)
        if not jobs:
            return logits
        import llguidance.numpy as llg_numpy

        bitmask = np.empty((len(indices), self.words), np.int32)
        assert self.executor is not None and self.uploader is not None
        llg_numpy.fill_next_token_bitmask_par(self.executor, jobs, bitmask)
        if len(indices) == len(rows):  # every row is constrained
            return apply_token_bitmask(logits, self.uploader.upload([bitmask])[0])
        device_bitmask, device_indices = self.uploader.upload([bitmask, np.array(indices)])
        masked = apply_token_bitmask(logits.index_select(0, device_indices), device_bitmask)
        return logits.index_copy(0, device_indices, masked)

    def without_drafts(self, rows: np.ndarray, drafts: list[list[int]]) -> list[list[int]]:
        """Proposals with none for constrained requests (they are never speculated)."""
        if not (self.matchers or self.compiling):
            return drafts
        constrained = [row in self.matchers or row in self.compiling for row in rows.tolist()]
        return [[] if c else d for c, d in zip(constrained, drafts)]

    def _matcher(self, row: int) -> llguidance.LLMatcher | None:
        """The row's matcher; one still compiling is waited for, copied and fed the output."""
        waiting = self.compiling.pop(row, None)
        if waiting is not None:
            future, output_ids = waiting
            try:
                matcher = future.result(timeout=GRAMMAR_COMPILE_TIMEOUT_S).deep_copy()
            except TimeoutError:  # llguidance bounds its work: never seen; the request stops
                logger.warning("a grammar took over %d s to compile", GRAMMAR_COMPILE_TIMEOUT_S)
                matcher = self._cache().error_matcher("compile timed out")
            matcher.consume_tokens(output_ids)
            self.matchers[row] = matcher
        return self.matchers.get(row)

    def _cache(self) -> GrammarCache:
        if self.cache is None:
            import llguidance

            eos = eos_token_ids(self.config.model_path, None)
            tokenizer = load_ll_tokenizer(self.config.tokenizer_path, self.vocab_size, eos)
            self.cache = GrammarCache(tokenizer)
            self.words = (tokenizer.vocab_size + 31) // 32
            self.executor = llguidance.LLExecutor(MASK_THREADS)
            self.uploader = Uploader(self.device)
        return self.cache

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
