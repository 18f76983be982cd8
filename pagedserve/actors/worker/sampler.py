"""Token sampling, vectorised over the batch (vLLM V1 semantics).

Order: raw log-softmax (for the logprobs, before anything else) -> allowed_token_ids (the other
tokens masked) -> bad words (the tokens that would complete one masked) -> logit_bias (added)
-> penalties (repetition over prompt + output, frequency/presence over the output) -> greedy
argmax for rows with temperature < 1e-5 -> temperature -> top-k / top-p / min-p support ->
Gumbel-max:
argmax(z + g) over the support, g = -log(-log u) standard Gumbel noise, samples from softmax(z)
on it.

The noise is counter-based: u for (row, token i) is a hash of the request's RNG key (its seed,
or one the scheduler drew for it) and the position of the token being sampled
(kernels.triton_sampling: `gumbel_noise` is the torch form, `_sample_kernel` the Triton one). A
token's draw depends only on the request and its index: not on the batch, the step, a
preemption, or the tensor-parallel rank. On a GPU the Triton kernels find the support and draw
(`use_triton`); elsewhere the torch functions below do the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.actors.messages import TokenLogprobs
from pagedserve.kernels import triton_sampling


@dataclass
class PenaltyState:
    presence: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32
    repetition: torch.Tensor  # [B] float32 (1.0: off)
    output_counts: torch.Tensor  # [B, vocab] float32: occurrences in the output so far
    prompt_mask: torch.Tensor  # [B, vocab] bool: token occurs in the prompt


@dataclass
class LogitBias:
    """Every biased (row, token) of a step: logits[rows[i], tokens[i]] += biases[i]."""

    rows: torch.Tensor  # [E] int64
    tokens: torch.Tensor  # [E] int64
    biases: torch.Tensor  # [E] float32


@dataclass
class AllowedTokens:
    """Rows that sample only among some tokens (allowed_token_ids): logits[rows[i], t] stays
    where keep[i, t], the rest become -inf."""

    rows: torch.Tensor  # [R] int64
    keep: torch.Tensor  # [R, vocab] bool


@dataclass
class BannedTokens:
    """Tokens some rows must not sample (their bad words): logits[rows[i], tokens[i]] = -inf."""

    rows: torch.Tensor  # [E] int64
    tokens: torch.Tensor  # [E] int64


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of one step; optional parts are None when no row uses them."""

    temperature: torch.Tensor | None  # [B] float32; < 1e-5 on greedy rows (None: all greedy)
    greedy: torch.Tensor | None  # [B] bool (None: all greedy)
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None = None  # [B] int64; >= vocab on rows without top-k
    top_p: torch.Tensor | None = None  # [B] float32; 1.0 on rows without top-p
    min_p: torch.Tensor | None = None  # [B] float32
    penalties: PenaltyState | None = None
    logit_bias: LogitBias | None = None
    allowed: AllowedTokens | None = None
    banned: BannedTokens | None = None
    seeds: torch.Tensor | None = None  # [B] int64: each row's RNG key (None: all greedy)
    positions: torch.Tensor | None = None  # [B] int64: position of the token each row samples
    num_logprobs: list[int | None] = field(default_factory=list)  # per row; None: not asked

    @property
    def wants_logprobs(self) -> bool:
        return any(n is not None for n in self.num_logprobs)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprob_tensors: LogprobTensors | None  # still on the device

    @property
    def logprobs(self) -> list[TokenLogprobs | None] | None:
        """Per row (None where not asked); syncs with the device."""
        return None if self.logprob_tensors is None else self.logprob_tensors.to_list()


class Sampler:
    def __init__(self, use_triton: bool) -> None:
        self.use_triton = use_triton  # the Triton support search and draw (GPU) or torch

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits: [B, vocab] (any float dtype; computed in float32)."""
        plain = (
            metadata.penalties is None
            and metadata.logit_bias is None
            and metadata.allowed is None
            and metadata.banned is None
        )
        if metadata.all_greedy and plain and not metadata.wants_logprobs:
            return SamplerOutput(token_ids=logits.argmax(dim=-1), logprob_tensors=None)
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if metadata.wants_logprobs else None
        if metadata.allowed is not None:
            allowed = metadata.allowed
            kept = logits[allowed.rows].masked_fill(~allowed.keep, float("-inf"))
            logits = logits.index_put((allowed.rows,), kept)
        if metadata.banned is not None:
            banned = metadata.banned
            masked = torch.full(banned.tokens.shape, float("-inf"), device=logits.device)
            logits = logits.index_put((banned.rows, banned.tokens), masked)
        if metadata.logit_bias is not None:
            bias = metadata.logit_bias
            logits = logits.index_put((bias.rows, bias.tokens), bias.biases, accumulate=True)
        if metadata.penalties is not None:
            logits = apply_penalties(logits, metadata.penalties)
        token_ids = self._sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = select_logprobs(raw_logprobs, token_ids, metadata.num_logprobs)
        return SamplerOutput(token_ids=token_ids, logprob_tensors=logprobs)

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if metadata.all_greedy:
            return logits.argmax(dim=-1)
        assert metadata.temperature is not None and metadata.greedy is not None
        assert metadata.seeds is not None and metadata.positions is not None
        if self.use_triton:
            return triton_sampling.sample_from_logits(
                logits, metadata.temperature, metadata.seeds, metadata.positions,
                metadata.top_k, metadata.top_p, metadata.min_p,
            )  # fmt: skip
        greedy_ids = None if metadata.all_random else logits.argmax(dim=-1)
        temperature = torch.where(metadata.greedy, 1.0, metadata.temperature)
        z = apply_top_k_top_p(logits / temperature.unsqueeze(1), metadata.top_k, metadata.top_p)
        if metadata.min_p is not None:
            z = apply_min_p(z, metadata.min_p)
        noise = triton_sampling.gumbel_noise(metadata.seeds, metadata.positions, z.shape[1])
        sampled = (z + noise).argmax(dim=-1)
        if greedy_ids is None:
            return sampled
        return torch.where(metadata.greedy, greedy_ids, sampled)


def apply_penalties(logits: torch.Tensor, penalties: PenaltyState) -> torch.Tensor:
    """Repetition (divide positive / multiply negative logits of seen tokens), then
    logits -= frequency * count + presence * [count > 0] over the output tokens."""
    in_output = penalties.output_counts > 0
    seen = in_output | penalties.prompt_mask
    repetition = penalties.repetition.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)
    logits = logits - penalties.frequency.unsqueeze(1) * penalties.output_counts
    return logits - penalties.presence.unsqueeze(1) * in_output


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (-inf) logits outside each row's top-k / top-p nucleus. Only top-p sorts the
    whole vocabulary; top-k alone uses torch.topk up to the largest k in the batch."""
    if top_p is None:
        return logits if top_k is None else apply_top_k_only(logits, top_k)
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth_index = (logits.shape[1] - top_k.clamp(1, logits.shape[1])).unsqueeze(1)
        kth = sorted_logits.gather(1, kth_index)
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    outside = cumulative <= (1.0 - top_p).unsqueeze(1)
    outside[:, -1] = False  # the most likely token always stays
    sorted_logits.masked_fill_(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab_size = logits.shape[1]
    enabled = (top_k > 0) & (top_k < vocab_size)
    if not bool(enabled.any()):
        return logits
    k = torch.where(enabled, top_k, 1)
    max_k = int(k.max())
    top_values = logits.topk(max_k, dim=-1).values
    kth = top_values.gather(1, (k - 1).unsqueeze(1))
    kth = torch.where(enabled.unsqueeze(1), kth, float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_min_p(z: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """-inf on the tokens whose probability is below min_p * (the row's top probability),
    i.e. z < max z + log(min_p) (rows with min_p 0 keep everything)."""
    limit = z.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    return z.masked_fill(z < limit, float("-inf"))


@dataclass
class LogprobTensors:
    """The logprobs a step returns, still on the device (no host sync until `to_list`)."""

    rows: list[int]  # batch rows that asked for logprobs
    num_logprobs: list[int | None]  # per batch row
    token_ids: torch.Tensor  # [len(rows)] the sampled tokens of those rows
    token_logprobs: torch.Tensor  # [len(rows)]
    ranks: torch.Tensor  # [len(rows)]
    top_logprobs: torch.Tensor | None  # [len(rows), max_n]
    top_ids: torch.Tensor | None

    def to_list(self) -> list[TokenLogprobs | None]:
        values: list[list[float]] = [[] for _ in self.rows]
        ids: list[list[int]] = [[] for _ in self.rows]
        if self.top_logprobs is not None and self.top_ids is not None:
            values, ids = self.top_logprobs.tolist(), self.top_ids.tolist()
        tokens, token_logprobs = self.token_ids.tolist(), self.token_logprobs.tolist()
        out: list[TokenLogprobs | None] = [None] * len(self.num_logprobs)
        for j, (row, rank) in enumerate(zip(self.rows, self.ranks.tolist())):
            n = self.num_logprobs[row] or 0
            out[row] = TokenLogprobs(tokens[j], token_logprobs[j], rank, ids[j][:n], values[j][:n])
        return out


def select_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int | None]
) -> LogprobTensors:
    """gather_logprobs' device half: index, gather, rank and top-k, all asynchronous."""
    rows = [i for i, n in enumerate(num_logprobs) if n is not None]
    index = torch.tensor(rows)
    if logprobs.is_cuda:  # a pageable copy could wait for the device's queue to drain
        index = index.pin_memory().to(logprobs.device, non_blocking=True)
    row_logprobs, row_tokens = logprobs.index_select(0, index), token_ids.index_select(0, index)
    token_logprobs = row_logprobs.gather(1, row_tokens.unsqueeze(1))
    ranks = (row_logprobs >= token_logprobs).sum(dim=-1)
    max_n = max(num_logprobs[i] or 0 for i in rows)
    top_values = top_ids = None
    if max_n:
        top_values, top_ids = row_logprobs.topk(max_n, dim=-1)
    return LogprobTensors(
        rows, num_logprobs, row_tokens, token_logprobs.squeeze(1), ranks, top_values, top_ids
    )
