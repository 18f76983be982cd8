"""One round of n-gram speculation on the device, per request: accept the last verify's samples,
look the next drafts up in the request's own tokens, write the next verify's rows.

State per request b (`RoundsState`): its tokens t[b, :n_b] (n_b = num_tokens[b]), the room it
has for more (room_end[b] - n_b: KV slots held, length limit), its block-table row, and the drafts
d_b tokens long that the last (or next) verify reads (-1: the request verifies nothing: no room).

Accept, given the verify's samples s[b, 0..k] (the target's token after the last known token and
after each draft): a = the longest prefix of drafts equal to the samples (a <= d_b), so the round
emits s[b, 0..a] (a + 1 tokens; none without room); t[b, n_b + j] = s[b, j] for j <= a,
n_b += a + 1; stats[b] = (d_b, a + 1 or 0, s[b, 0..k]).

Lookup (speculative.NgramProposer.lookup's rule): for each end e <= n_b - 1 the run length
r(e) = the largest r <= prompt_lookup_max with t[e - 1 - j] = t[n_b - 1 - j] for all j < r (the
suffix n-gram of length r occurs ending at e, before the last token). The longest run
>= prompt_lookup_min wins, the latest end among equal ones: max over e of r(e) * (C + 1) + e.
The drafts are t[e .. e + k - 1] cut at n_b, then at the request's room.

Write: verify row b * (1 + k) + i, i <= d_b, is the token at position p = n_b - 1 + i (the last
known token, then the drafts) with p + 1 keys, KV slot table[p // block_size] * block_size +
p % block_size; rows i > d_b are padding (token 0, position 0, no KV write, one key), the decode
step's convention (cuda_graphs.py).

The Triton kernel runs the three phases in one program per request; `advance_reference` is the
same in torch (the CPU path, and the tests' reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = ["Phases", "RoundsState", "RowFields", "advance", "advance_reference", "advance_triton"]

_BLOCK = 1024  # token columns a program scans at a time in the lookup


@dataclass
class RoundsState:
    tokens: torch.Tensor  # [B, C] int64; column C - 1 only absorbs dropped writes
    num_tokens: torch.Tensor  # [B] int64
    room_end: torch.Tensor  # [B] int64: a request may verify up to room_end - num_tokens drafts
    tables: torch.Tensor  # [B, W] int32: block-table rows
    drafts: torch.Tensor  # [B, k] int64
    num_drafts: torch.Tensor  # [B] int64; -1: no verify (no room)


@dataclass
class RowFields:
    """The decode step's input rows the write phase fills (cuda_graphs.DecodeStep's buffers)."""

    token_ids: torch.Tensor  # int64
    positions: torch.Tensor  # int64
    slot_mapping: torch.Tensor  # int64
    seq_lens: torch.Tensor  # int32


@dataclass
class Phases:
    """A round's phases, each run where given: accept `samples` [B * (1 + k)] (the verify's)
    into the state and `stats` [B, 3 + k]; look drafts up with lookup = (prompt_lookup_min,
    prompt_lookup_max); write the next verify's rows into `rows` (their first B * (1 + k))."""

    samples: torch.Tensor | None = None
    stats: torch.Tensor | None = None
    rows: RowFields | None = None
    lookup: tuple[int, int] | None = None


def advance(state: RoundsState, phases: Phases, block_size: int) -> None:
    """One round of `phases` on `state`: the Triton kernel on a GPU, the reference elsewhere."""
    _check(state, phases)
    on_gpu = state.tokens.device.type == "cuda"
    (advance_triton if on_gpu else advance_reference)(state, phases, block_size)


def advance_triton(state: RoundsState, phases: Phases, block_size: int) -> None:
    """`advance` as the Triton kernel (any device Triton runs on: its interpreter too)."""
    batch, columns = state.tokens.shape
    k = state.drafts.shape[1]
    samples, stats, rows, lookup = phases.samples, phases.stats, phases.rows, phases.lookup
    dummy = state.num_tokens
    min_n, max_n = lookup if lookup is not None else (1, 1)
    _advance_kernel[(batch,)](
        state.tokens, state.num_tokens, state.room_end, state.tables, state.drafts,
        state.num_drafts, dummy if samples is None else samples,
        dummy if stats is None else stats,
        dummy if rows is None else rows.token_ids, dummy if rows is None else rows.positions,
        dummy if rows is None else rows.slot_mapping, dummy if rows is None else rows.seq_lens,
        columns, state.tables.shape[1], block_size, min_n,
        K=k, WIDTH_POW2=triton.next_power_of_2(k + 1), MAX_N=max_n, BLOCK=_BLOCK,
        ACCEPT=samples is not None, LOOKUP=lookup is not None, WRITE=rows is not None,
        num_warps=4,
    )  # fmt: skip


def _check(state: RoundsState, phases: Phases) -> None:
    batch, _ = state.tokens.shape
    k = state.drafts.shape[1]
    samples, stats, rows = phases.samples, phases.stats, phases.rows
    int64 = (state.tokens, state.num_tokens, state.room_end, state.drafts, state.num_drafts)
    if any(t.dtype != torch.int64 or not t.is_contiguous() for t in int64):
        raise ValueError("the rounds' state must be contiguous int64 (block tables int32)")
    if state.tables.dtype != torch.int32 or not state.tables.is_contiguous():
        raise ValueError("block-table rows must be contiguous int32")
    if state.drafts.shape[0] != batch or state.num_tokens.shape != (batch,):
        raise ValueError("the state's tensors must have one row per request")
    verify_rows = batch * (k + 1)
    if samples is not None and (samples.shape != (verify_rows,) or samples.dtype != torch.int64):
        raise ValueError(f"samples must be [{verify_rows}] int64")
    if stats is not None and (stats.shape != (batch, k + 3) or not stats.is_contiguous()):
        raise ValueError(f"stats must be a contiguous [{batch}, {k + 3}]")
    if rows is not None and (
        rows.seq_lens.dtype != torch.int32
        or min(f.numel() for f in vars(rows).values()) < verify_rows
    ):
        raise ValueError("the row fields must hold every verify row (seq_lens int32)")


_RUNTIME_ARGS = [
    "tokens_ptr", "num_tokens_ptr", "room_end_ptr", "tables_ptr", "drafts_ptr", "num_drafts_ptr",
    "samples_ptr", "stats_ptr", "ids_ptr", "positions_ptr", "slots_ptr", "seq_lens_ptr",
    "columns", "table_width", "block_size", "min_n",
]  # fmt: skip


# one compile per (k, prompt_lookup_max, phases): no specialising on the values or alignments
# of the arguments, which change from step to step (a compile inside a timed step costs ~1 s)
@triton.jit(do_not_specialize=_RUNTIME_ARGS)
def _advance_kernel(
    tokens_ptr, num_tokens_ptr, room_end_ptr, tables_ptr, drafts_ptr, num_drafts_ptr,
    samples_ptr, stats_ptr, ids_ptr, positions_ptr, slots_ptr, seq_lens_ptr,
    columns, table_width, block_size, min_n,
    K: tl.constexpr, WIDTH_POW2: tl.constexpr, MAX_N: tl.constexpr, BLOCK: tl.constexpr,
    ACCEPT: tl.constexpr, LOOKUP: tl.constexpr, WRITE: tl.constexpr,
):  # fmt: skip
    """Program b: request b's accept, lookup and row writes (the module's docstring)."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, WIDTH_POW2).to(tl.int64)
    in_width = i < K + 1
    row_tokens = tokens_ptr + b * columns
    n = tl.load(num_tokens_ptr + b)
    d = tl.load(num_drafts_ptr + b)
    if ACCEPT:
        samples = tl.load(samples_ptr + b * (K + 1) + i, mask=in_width, other=0)
        drafts = tl.load(drafts_ptr + b * K + i, mask=i < K, other=-1)
        disagree = (i >= d) | (drafts != samples)  # true from K on: d <= K
        accepted = tl.min(tl.where(disagree, i, WIDTH_POW2), axis=0)
        last_kept = tl.where(d >= 0, accepted, -1)  # no room: nothing emitted
        emitted = last_kept + 1
        tl.store(row_tokens + n + i, samples, mask=i <= last_kept)
        stats_row = stats_ptr + b * (K + 3)
        tl.store(stats_row, d)
        tl.store(stats_row + 1, emitted)
        tl.store(stats_row + 2 + i, samples, mask=in_width)
        n = n + emitted
        tl.store(num_tokens_ptr + b, n)
        tl.debug_barrier()
    if LOOKUP:
        best = tl.full((), -1, tl.int64)
        for start in range(0, columns, BLOCK):
            e = start + tl.arange(0, BLOCK).to(tl.int64)
            ends = e <= n - 1
            run = ends
            length = tl.zeros((BLOCK,), tl.int64)
            for j in tl.static_range(MAX_N):
                at = n - 1 - j
                # before the first token: -2, which no token (nor the -1 of `other`) equals
                suffix = tl.where(at >= 0, tl.load(row_tokens + tl.maximum(at, 0)), -2)
                earlier = tl.load(row_tokens + e - 1 - j, mask=run & (e - 1 - j >= 0), other=-1)
                run = run & (earlier == suffix)
                length += run.to(tl.int64)
            score = tl.where(ends & (length >= min_n), length * (columns + 1) + e, -1)
            best = tl.maximum(best, tl.max(score, axis=0))
        found = best >= 0
        end = tl.where(found, best % (columns + 1), 0)
        count = tl.where(found, tl.minimum(K, n - end), 0)
        room = tl.load(room_end_ptr + b) - n
        d = tl.where(room >= 0, tl.minimum(count, room), -1)
        proposed = tl.load(row_tokens + end + i, mask=(i < K) & (end + i < columns), other=0)
        tl.store(drafts_ptr + b * K + i, proposed, mask=i < K)
        tl.store(num_drafts_ptr + b, d)
        tl.debug_barrier()
    if WRITE:
        last = tl.load(row_tokens + n - 1)
        after = tl.load(drafts_ptr + b * K + i - 1, mask=(i >= 1) & in_width, other=0)
        ids = tl.where(i == 0, last, after)
        position = n - 1 + i
        valid = (i <= d) & in_width
        block = tl.load(tables_ptr + b * table_width + position // block_size, mask=valid, other=0)
        slot = block.to(tl.int64) * block_size + position % block_size
        out = b * (K + 1) + i
        tl.store(ids_ptr + out, tl.where(valid, ids, 0), mask=in_width)
        tl.store(positions_ptr + out, tl.where(valid, position, 0), mask=in_width)
        tl.store(slots_ptr + out, tl.where(valid, slot, -1), mask=in_width)
        seq_len = tl.where(valid, position + 1, 1).to(tl.int32)
        tl.store(seq_lens_ptr + out, seq_len, mask=in_width)


def advance_reference(state: RoundsState, phases: Phases, block_size: int) -> None:
    """`advance` in torch ops (the CPU path)."""
    samples, stats, rows, lookup = phases.samples, phases.stats, phases.rows, phases.lookup
    batch, columns = state.tokens.shape
    k = state.drafts.shape[1]
    i = torch.arange(k + 1, device=state.tokens.device)
    if samples is not None:
        assert stats is not None
        samples = samples.view(batch, k + 1)
        d = state.num_drafts
        agree = (state.drafts == samples[:, :k]) & (i[:k] < d[:, None])
        accepted = agree.long().cumprod(1).sum(1)
        live = d >= 0
        emitted = torch.where(live, accepted + 1, 0)
        keep = (i <= accepted[:, None]) & live[:, None]
        index = torch.where(keep, state.num_tokens[:, None] + i, columns - 1)
        state.tokens.scatter_(1, index, samples)
        stats[:, 0], stats[:, 1], stats[:, 2:] = d, emitted, samples
        state.num_tokens += emitted
    if lookup is not None:
        drafts, count = lookup_reference(state.tokens, state.num_tokens, k, *lookup)
        room = state.room_end - state.num_tokens
        state.drafts.copy_(drafts)
        state.num_drafts.copy_(torch.where(room >= 0, torch.minimum(count, room), -1))
    if rows is not None:
        _write_rows_reference(state, rows, block_size)


def lookup_reference(
    tokens: torch.Tensor, num_tokens: torch.Tensor, k: int, min_n: int, max_n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's drafts [B, k] (valid up to count) and their count [B]."""
    batch, columns = tokens.shape
    padded = F.pad(tokens, (max_n, 0), value=-1)  # column e + max_n - 1 - j: t[e - 1 - j]
    ends = torch.arange(columns, device=tokens.device)
    run = ends[None, :] <= (num_tokens - 1)[:, None]
    is_end = run.clone()
    length = torch.zeros(batch, columns, dtype=torch.int64, device=tokens.device)
    for j in range(max_n):
        at = num_tokens - 1 - j
        suffix = tokens.gather(1, at.clamp(min=0)[:, None])
        earlier = padded[:, max_n - 1 - j : max_n - 1 - j + columns]
        run &= (earlier == suffix) & (at >= 0)[:, None]
        length += run
    score = torch.where(is_end & (length >= min_n), length * (columns + 1) + ends, -1)
    best = score.max(dim=1).values
    found = best >= 0
    end = torch.where(found, best % (columns + 1), 0)
    offsets = (end[:, None] + torch.arange(k, device=tokens.device)).clamp(max=columns - 1)
    count = torch.where(found, torch.minimum(num_tokens - end, torch.full_like(end, k)), 0)
    return tokens.gather(1, offsets), count


def _write_rows_reference(state: RoundsState, rows: RowFields, block_size: int) -> None:
    batch, k = state.drafts.shape
    i = torch.arange(k + 1, device=state.tokens.device)
    n = state.num_tokens[:, None]
    last = state.tokens.gather(1, n - 1)
    ids = torch.cat([last, state.drafts], dim=1)
    position = n - 1 + i
    valid = i <= state.num_drafts[:, None]
    column = (position // block_size).clamp(max=state.tables.shape[1] - 1)
    block = state.tables.gather(1, column).long()
    total = batch * (k + 1)
    rows.token_ids[:total] = torch.where(valid, ids, 0).flatten()
    rows.positions[:total] = torch.where(valid, position, 0).flatten()
    slot = block * block_size + position % block_size
    rows.slot_mapping[:total] = torch.where(valid, slot, -1).flatten()
    rows.seq_lens[:total] = torch.where(valid, position + 1, 1).flatten()
