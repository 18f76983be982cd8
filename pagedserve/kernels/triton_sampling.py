"""Triton sampling without a vocabulary sort: top-k / top-p / min-p as one threshold per row,
found by a multi-pivot search, and a one-pass Gumbel-max sampler.

Semantics (those of the engine's torch sampler, vLLM V1): with z = logits / temperature,
- top-k keeps z >= the k-th largest z (ties at the k-th value all stay); k <= 0 or k >= vocab: off;
- top-p then keeps a token iff the probability mass of the top-k-kept tokens strictly above it
  (renormalised over the top-k set) is < p; the most likely token always stays; p >= 1: off;
- min-p keeps p_i >= min_p * max_j p_j, i.e. z_i >= max z + log(min_p); min_p <= 0: off.
Each of these keeps {z >= t} for one threshold t per row, so a row's support is z >= threshold.

Thresholds (`sampling_thresholds`). First from candidates: the 256 largest z of each row
(torch.topk, no sort of the vocabulary) settle every row whose top-k set and nucleus lie among
them, with a few [B, 256] torch ops. The other rows (k > 256, very flat distributions) take
the exact search kernel on the GPU, chosen per row by a flag (no host sync).

Search (`_threshold_kernel`, one program per row). Floats map monotonically onto
int32 keys (`_float_key`), so "the k-th largest value" and "the smallest value whose mass above
is < p" are searches over integers: each pass over the row evaluates NUM_PIVOTS evenly spaced
pivot keys at once (a count or a mass per pivot) and shrinks the bracket [lo, hi] by a factor
NUM_PIVOTS + 1, so 32-bit keys take <= 8 passes (4 bits a pass with 16 pivots). The result is
exact (an element's value for top-k), up to fp32 summation order in the masses.

Sampling (`_sample_kernel`; small vocabularies: several rows a program, small batches: a row
split over several programs, merged by an argmax): argmax_i (z_i + g_i) over the kept tokens with
g_i = -log(-log u_i) standard Gumbel noise, which samples from softmax(z) restricted to the
support (the exponential race argmax p_i / q_i, q ~ Exp(1), of the torch sampler, in log form).
u_i comes from a counter-based hash (SplitMix64's mixer) of (seed, offset, i), so a request's
draw at a given offset (e.g. its output position) does not depend on the rest of the batch.
Rows with temperature < 1e-5 are greedy: argmax of the raw logits (first index on ties).

The pure-torch references (`reference_keep_mask`, `reference_probs`) sort the vocabulary.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = [
    "GREEDY_TEMPERATURE",
    "apply_top_k_top_p",
    "gumbel_noise",
    "random_seeds",
    "reference_keep_mask",
    "reference_probs",
    "sample_from_logits",
    "sampling_thresholds",
]

GREEDY_TEMPERATURE = 1e-5  # temperature below this: greedy (as in the torch sampler)
_BLOCK_V = 256
_NUM_PIVOTS = 16
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _float_key(z):
    """Order-preserving int32 key of fp32 z (larger z, larger key; -0.0 just below +0.0)."""
    bits = z.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _key_float(key):
    """Inverse of _float_key (key: an int scalar within the int32 range)."""
    k32 = key.to(tl.int32)
    return tl.where(k32 >= 0, k32, k32 ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _load_z(row_ptr, start, vocab, temperature, BLOCK_V: tl.constexpr):
    """z = logits / temperature for columns start .. start + BLOCK_V (-inf past the vocab)."""
    offs = start + tl.arange(0, BLOCK_V)
    mask = offs < vocab
    x = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    return x / temperature, mask


@triton.jit
def _row_stats(row_ptr, vocab, temperature, BLOCK_V: tl.constexpr):
    """(m = max z, Z = sum exp(z - m), smallest key) in one online pass."""
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    key_min = tl.full([], 2147483647, tl.int32)
    for start in range(0, vocab, BLOCK_V):
        z, mask = _load_z(row_ptr, start, vocab, temperature, BLOCK_V)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.exp(m - m_safe) + tl.sum(tl.exp(z - m_safe), axis=0)
        m = m_new
        key_min = tl.minimum(key_min, tl.min(tl.where(mask, _float_key(z), 2147483647), axis=0))
    return m, total, key_min


@triton.jit
def _pivots(lo, hi, NUM_PIVOTS: tl.constexpr):
    """NUM_PIVOTS keys evenly spaced in (lo, hi) (every key there once hi - lo <= NUM_PIVOTS+1)."""
    j = tl.arange(0, NUM_PIVOTS).to(tl.int64) + 1
    return (lo + ((hi - lo) * j) // (NUM_PIVOTS + 1)).to(tl.int32)


@triton.jit
def _search_top_k(
    row_ptr, vocab, temperature, k, lo, hi, BLOCK_V: tl.constexpr, NUM_PIVOTS: tl.constexpr
):
    """The largest key K with count(key >= K) >= k, given count(key >= lo) >= k and
    count(key >= hi) < k: the k-th largest key."""
    while hi - lo > 1:
        pivots = _pivots(lo, hi, NUM_PIVOTS)
        counts = tl.zeros([BLOCK_V, NUM_PIVOTS], tl.int32)
        for start in range(0, vocab, BLOCK_V):
            z, mask = _load_z(row_ptr, start, vocab, temperature, BLOCK_V)
            above = (_float_key(z)[:, None] >= pivots[None, :]) & mask[:, None]
            counts += above.to(tl.int32)
        ok = tl.sum(counts, axis=0) >= k  # true for the low pivots
        lo = tl.maximum(lo, tl.max(tl.where(ok, pivots, -2147483648), axis=0).to(tl.int64))
        hi = tl.minimum(hi, tl.min(tl.where(ok, 2147483647, pivots), axis=0).to(tl.int64))
    return lo


@triton.jit
def _mass_from(row_ptr, vocab, temperature, m, key_lo, BLOCK_V: tl.constexpr):
    """sum exp(z - m) over the tokens with key >= key_lo."""
    total = tl.zeros([], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        z, mask = _load_z(row_ptr, start, vocab, temperature, BLOCK_V)
        keep = mask & (_float_key(z) >= key_lo)
        total += tl.sum(tl.where(keep, tl.exp(z - m), 0.0), axis=0)
    return total


@triton.jit
def _search_top_p(
    row_ptr, vocab, temperature, m, target, lo, hi, BLOCK_V: tl.constexpr, NUM_PIVOTS: tl.constexpr
):
    """The smallest key K in (lo, hi] with mass(key > K) < target (mass = sum exp(z - m)),
    given that lo fails and hi (the top key) is taken to pass: tokens with key >= K stay."""
    while hi - lo > 1:
        pivots = _pivots(lo, hi, NUM_PIVOTS)
        mass = tl.zeros([BLOCK_V, NUM_PIVOTS], tl.float32)
        for start in range(0, vocab, BLOCK_V):
            z, mask = _load_z(row_ptr, start, vocab, temperature, BLOCK_V)
            weight = tl.where(mask, tl.exp(z - m), 0.0)
            mass += tl.where(_float_key(z)[:, None] > pivots[None, :], weight[:, None], 0.0)
        ok = tl.sum(mass, axis=0) < target  # true for the high pivots
        hi = tl.minimum(hi, tl.min(tl.where(ok, pivots, 2147483647), axis=0).to(tl.int64))
        lo = tl.maximum(lo, tl.max(tl.where(ok, -2147483648, pivots), axis=0).to(tl.int64))
    return hi


@triton.jit
def _threshold_kernel(
    logits_ptr,
    stride_row,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    skip_ptr,
    out_ptr,
    vocab,
    HAS_SKIP: tl.constexpr,
    HAS_TEMPERATURE: tl.constexpr,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
):
    """out[row] = the smallest z kept by the row's top-k, top-p and min-p (-inf: keep all).
    top-k: t_k = the k-th largest z; top-p over {z >= t_k}: the smallest key K with
    mass(z > K) < p * mass(z >= t_k); min-p: max z + log(min_p). HAS_SKIP: rows with
    skip[row] != 0 (already resolved from candidates) are left alone."""
    row = tl.program_id(0).to(tl.int64)
    if HAS_SKIP:
        if tl.load(skip_ptr + row) != 0:
            return
    row_ptr = logits_ptr + row * stride_row
    temperature = 1.0
    if HAS_TEMPERATURE:
        temperature = tl.load(temperature_ptr + row).to(tl.float32)
        temperature = tl.where(temperature < 1e-5, 1.0, temperature)
    m, total, key_min = _row_stats(row_ptr, vocab, temperature, BLOCK_V)
    key_max = _float_key(m).to(tl.int64)
    threshold = tl.full([], float("-inf"), tl.float32)
    key_k = key_min.to(tl.int64)
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + row).to(tl.int64)
        if (k > 0) & (k < vocab):
            key_k = _search_top_k(row_ptr, vocab, temperature, k, key_k, key_max + 1, BLOCK_V,
                                  NUM_PIVOTS)  # fmt: skip
            threshold = _key_float(key_k)
    if HAS_TOP_P:
        p = tl.load(top_p_ptr + row).to(tl.float32)
        if p < 1.0:
            if key_k > key_min:
                total = _mass_from(row_ptr, vocab, temperature, m, key_k, BLOCK_V)
            key_p = _search_top_p(row_ptr, vocab, temperature, m, p * total, key_k - 1, key_max,
                                  BLOCK_V, NUM_PIVOTS)  # fmt: skip
            threshold = tl.maximum(threshold, _key_float(key_p))
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + row).to(tl.float32)
        if min_p > 0.0:
            threshold = tl.maximum(threshold, m + tl.log(min_p))
    tl.store(out_ptr + row, threshold)


@triton.jit
def _mix64(x):
    """SplitMix64's finaliser: a bijective avalanche of uint64 x."""
    x = x ^ (x >> 30)
    x = x * 0xBF58476D1CE4E5B9
    x = x ^ (x >> 27)
    x = x * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _gumbel(stream, cols):
    """Standard Gumbel noise -log(-log u): u in (0, 1) from 23 bits of the hash of the row's
    stream key (uint64 [R, 1]) and the column (counter-based, like SplitMix64)."""
    bits = _mix64(stream + cols.to(tl.uint64)[None, :] * 0x9E3779B97F4A7C15) >> 41
    u = (bits.to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _sample_kernel(
    logits_ptr,
    stride_row,
    temperature_ptr,
    threshold_ptr,
    seeds_ptr,
    offsets_ptr,
    out_ptr,
    best_ptr,
    batch,
    vocab,
    split_len,
    HAS_THRESHOLD: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """out[row] = argmax_i (z_i + gumbel_i) over z_i >= threshold[row], z = logits / T, for
    BLOCK_R rows; greedy rows (T < 1e-5): argmax_i logits_i. Ties keep the first index.
    The noise of (row, i) depends only on (seeds[row], offsets[row], i). SPLIT: program
    (r, s) scans columns [s * split_len, (s + 1) * split_len) and writes its best score and
    index to best[row, s] / out[row, s] ([batch, num_splits]) for a final argmax."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    split = tl.program_id(1)
    col_start = split * split_len
    col_end = tl.minimum(col_start + split_len, vocab)
    row_mask = rows < batch
    row_ptrs = logits_ptr + rows.to(tl.int64)[:, None] * stride_row
    temperature = tl.load(temperature_ptr + rows, mask=row_mask, other=1.0).to(tl.float32)
    greedy = temperature < 1e-5
    temperature = tl.where(greedy, 1.0, temperature)
    threshold = tl.full([BLOCK_R], float("-inf"), tl.float32)
    if HAS_THRESHOLD:
        threshold = tl.load(threshold_ptr + rows, mask=row_mask, other=float("-inf"))
    seed = tl.load(seeds_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    offset = tl.load(offsets_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    key = seed.to(tl.uint64, bitcast=True) ^ _mix64(offset.to(tl.uint64, bitcast=True) + 1)
    stream = _mix64(key)[:, None]
    best = tl.full([BLOCK_R], float("-inf"), tl.float32)
    best_index = tl.zeros([BLOCK_R], tl.int32)
    for start in range(col_start, col_end, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = row_mask[:, None] & (cols < col_end)[None, :]
        x = tl.load(row_ptrs + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        z = x / temperature[:, None]
        noisy = tl.where(z >= threshold[:, None], z + _gumbel(stream, cols), float("-inf"))
        score = tl.where(mask, tl.where(greedy[:, None], z, noisy), float("-inf"))
        chunk_best = tl.max(score, axis=1)
        better = chunk_best > best
        best = tl.where(better, chunk_best, best)
        best_index = tl.where(better, start + tl.argmax(score, axis=1), best_index)
    if SPLIT:
        dst = rows * tl.num_programs(1) + split
        tl.store(best_ptr + dst, best, mask=row_mask)
        tl.store(out_ptr + dst, best_index.to(tl.int64), mask=row_mask)
    else:
        tl.store(out_ptr + rows, best_index.to(tl.int64), mask=row_mask)


# --------------------------------------------------------------------------- launchers


def sampling_thresholds(
    logits: torch.Tensor,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    *,
    candidates: int = 256,
) -> torch.Tensor:
    """[B] float32: row b keeps the tokens with logits[b] / temperature[b] >= threshold[b].

    logits [B, vocab] (fp32/bf16/fp16, rows contiguous); temperature [B] (None: 1; < 1e-5 is
    treated as 1); top_k [B] int (<= 0 or >= vocab: off); top_p [B] float (>= 1: off);
    min_p [B] float (<= 0: off). None turns a filter off for every row.

    With top-k / top-p, the `candidates` largest values of each row (torch.topk, no sort of
    the vocabulary) settle every row whose top-k and nucleus lie among them; the search
    kernel handles the others on the GPU (no host sync). candidates=0: the kernel for all."""
    _check_logits(logits)
    batch, vocab = logits.shape
    params = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}
    for name, value in params.items():
        _check_row_param(value, name, batch, logits.device)
    out = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if batch == 0:
        return out
    skip = None
    if 0 < candidates < vocab and (top_k is not None or top_p is not None):
        out, resolved = _candidate_thresholds(logits, temperature, top_k, top_p, min_p,
                                              candidates)  # fmt: skip
        skip = resolved.to(torch.int8)
    _threshold_kernel[(batch,)](
        logits, logits.stride(0),
        *(value if value is not None else out for value in params.values()),
        skip if skip is not None else out, out, vocab,
        HAS_SKIP=skip is not None, HAS_TEMPERATURE=temperature is not None,
        HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None, HAS_MIN_P=min_p is not None,
        BLOCK_V=_BLOCK_V, NUM_PIVOTS=_NUM_PIVOTS, num_warps=4,
    )  # fmt: skip
    return out


def _candidate_thresholds(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    num_candidates: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(thresholds, resolved) from each row's `num_candidates` largest z (sorted by topk).

    top-k: the k-th candidate if k <= num_candidates. top-p: with w = exp(z - max) over the
    top-k-kept candidates, the nucleus is the prefix whose exclusive cumsum of w is < p * Z_k
    (Z_k: the top-k mass, else the whole row's); the row is resolved if that prefix ends
    inside the candidates (or inside a top-k set that the candidates hold)."""
    z = _scaled(logits, temperature)
    batch, vocab = z.shape
    values = z.topk(num_candidates, dim=1).values  # descending
    threshold = torch.full((batch,), float("-inf"), device=z.device)
    resolved = torch.ones(batch, dtype=torch.bool, device=z.device)
    k_held = torch.zeros(batch, dtype=torch.bool, device=z.device)  # top-k set in candidates
    if top_k is not None:
        k = top_k.to(torch.int64)
        k_on = (k > 0) & (k < vocab)
        kth = values.gather(1, (k.clamp(1, num_candidates) - 1).unsqueeze(1)).squeeze(1)
        threshold = torch.where(k_on, kth, threshold)
        # ties with the k-th value may continue past the candidates: leave those to the kernel
        k_held = k_on & (k <= num_candidates) & (values[:, -1] < kth)
        resolved &= ~k_on | k_held
    if top_p is not None:
        top = values[:, :1]
        weights = torch.exp(values - top) * (values >= threshold.unsqueeze(1))
        total = torch.where(k_held, weights.sum(dim=1), torch.exp(z - top).sum(dim=1))
        above = weights.cumsum(dim=1) - weights
        kept = (above < (top_p * total).unsqueeze(1)).sum(dim=1).clamp(min=1)
        cut = values.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)
        p_on = top_p < 1
        threshold = torch.where(p_on, torch.maximum(threshold, cut), threshold)
        resolved &= ~p_on | (kept < num_candidates) | k_held
    if min_p is not None:
        limit = values[:, 0] + torch.log(min_p.float())
        threshold = torch.where(min_p > 0, torch.maximum(threshold, limit), threshold)
    return threshold, resolved


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """logits with -inf outside each row's top-k / top-p support (no vocabulary sort); a
    drop-in for the torch sampler's apply_top_k_top_p (logits already temperature-scaled)."""
    if top_k is None and top_p is None:
        return logits
    threshold = sampling_thresholds(logits, top_k=top_k, top_p=top_p)
    return logits.masked_fill(logits.float() < threshold.unsqueeze(1), float("-inf"))


def sample_from_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    thresholds: torch.Tensor | None = None,
    *,
    vocab_splits: int | None = None,
) -> torch.Tensor:
    """[B] int64 token ids: a sample from softmax(logits / temperature) restricted to the
    top-k / top-p / min-p support, or the argmax on rows with temperature < 1e-5.

    seeds [B] int64: each row's noise key (e.g. the request's seed, or `random_seeds` for
    unseeded rows); offsets [B] int64 (None: 0): the counter, e.g. the request's number of
    output tokens, so (seed, offset) fixes the draw whatever else is in the batch.
    thresholds [B] float32: precomputed `sampling_thresholds` (then no top_k/top_p/min_p).
    vocab_splits: programs per row (None: enough to fill the GPU for small batches)."""
    _check_logits(logits)
    batch, vocab = logits.shape
    _check(temperature is not None, "temperature is required")
    _check_row_param(temperature, "temperature", batch, logits.device)
    _check_row_param(seeds, "seeds", batch, logits.device)
    _check(seeds.dtype in (torch.int32, torch.int64), "seeds must be an integer tensor")
    if offsets is None:
        offsets = torch.zeros(batch, dtype=torch.int64, device=logits.device)
    _check_row_param(offsets, "offsets", batch, logits.device)
    if batch == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    if thresholds is None and (top_k is not None or top_p is not None or min_p is not None):
        thresholds = sampling_thresholds(logits, temperature, top_k, top_p, min_p)
    elif thresholds is not None:
        _check(top_k is None and top_p is None and min_p is None, "thresholds replace filters")
        _check_row_param(thresholds, "thresholds", batch, logits.device)
        _check(thresholds.dtype == torch.float32, "thresholds must be float32")
    block_v = min(1024, triton.next_power_of_2(vocab))
    block_r = 1 if vocab >= 4096 else min(64, 4096 // block_v, triton.next_power_of_2(batch))
    row_programs = triton.cdiv(batch, block_r)
    if vocab_splits is None:
        sms = _num_sms(logits.device.index) if logits.device.type == "cuda" else 1
        vocab_splits = min(triton.cdiv(2 * sms, row_programs), triton.cdiv(vocab, 8192))
    vocab_splits = max(1, min(vocab_splits, triton.cdiv(vocab, block_v)))
    split_len = triton.cdiv(triton.cdiv(vocab, vocab_splits), block_v) * block_v
    vocab_splits = triton.cdiv(vocab, split_len)
    out = torch.empty((batch, vocab_splits), dtype=torch.int64, device=logits.device)
    best = torch.empty((batch, vocab_splits), dtype=torch.float32, device=logits.device)
    _sample_kernel[(row_programs, vocab_splits)](
        logits, logits.stride(0), temperature, thresholds if thresholds is not None else best,
        seeds, offsets, out, best, batch, vocab, split_len,
        HAS_THRESHOLD=thresholds is not None, SPLIT=vocab_splits > 1, BLOCK_R=block_r,
        BLOCK_V=block_v, num_warps=4,
    )  # fmt: skip
    if vocab_splits == 1:
        return out.squeeze(1)
    return out.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1)


@functools.cache
def _num_sms(index: int | None) -> int:
    device = torch.cuda.current_device() if index is None else index
    return torch.cuda.get_device_properties(device).multi_processor_count


def random_seeds(
    batch: int, device: torch.device, generator: torch.Generator | None = None
) -> torch.Tensor:
    """[batch] int64 fresh seeds for unseeded rows, drawn on the CPU from `generator`."""
    seeds = torch.randint(0, 2**62, (batch,), generator=generator, dtype=torch.int64)
    return seeds.to(device)


# --------------------------------------------------------------------------- references


def reference_keep_mask(
    logits: torch.Tensor,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, vocab] bool support by sorting each row (float64 masses); same arguments and
    semantics as sampling_thresholds."""
    z = _scaled(logits, temperature)
    batch, vocab = z.shape
    sorted_z, order = z.sort(dim=-1, descending=True)
    keep = torch.ones_like(sorted_z, dtype=torch.bool)
    if top_k is not None:
        k = top_k.to(torch.int64)
        enabled = (k > 0) & (k < vocab)
        kth = sorted_z.gather(1, (k.clamp(1, vocab) - 1).unsqueeze(1))
        keep &= ~enabled.unsqueeze(1) | (sorted_z >= kth)
    if top_p is not None:
        probs = sorted_z.double().masked_fill(~keep, float("-inf")).softmax(dim=-1)
        mass_above = probs.cumsum(dim=-1) - probs
        nucleus = mass_above < top_p.double().unsqueeze(1)
        nucleus[:, 0] = True
        keep &= nucleus | (top_p >= 1).unsqueeze(1)
    mask = torch.empty_like(keep).scatter_(1, order, keep)
    if min_p is not None:
        limit = z.amax(dim=-1, keepdim=True) + torch.log(min_p.float()).unsqueeze(1)
        mask &= (z >= limit) | (min_p <= 0).unsqueeze(1)
    return mask


def reference_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, vocab] float64: the distribution sample_from_logits draws from (one-hot argmax on
    greedy rows)."""
    z = _scaled(logits, temperature).double()
    keep = reference_keep_mask(logits, temperature, top_k, top_p, min_p)
    probs = z.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    greedy = (temperature < GREEDY_TEMPERATURE).unsqueeze(1)
    one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy, one_hot, probs)


def _as_int64(value: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


_MIX1, _MIX2 = _as_int64(0xBF58476D1CE4E5B9), _as_int64(0x94D049BB133111EB)
_GOLDEN = _as_int64(0x9E3779B97F4A7C15)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 tensors read as uint64."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64_torch(x: torch.Tensor) -> torch.Tensor:
    """_mix64 on int64 tensors (wrapping multiplication: the same bits as uint64)."""
    x = x ^ _shift_right(x, 30)
    x = x * _MIX1
    x = x ^ _shift_right(x, 27)
    x = x * _MIX2
    return x ^ _shift_right(x, 31)


def gumbel_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32: the Gumbel noise `_sample_kernel` adds, bit for bit the same hash:
    row b's noise depends only on (seeds[b], offsets[b]) (int64 [B])."""
    key = seeds.to(torch.int64) ^ _mix64_torch(offsets.to(torch.int64) + 1)
    stream = _mix64_torch(key).unsqueeze(1)
    cols = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    bits = _shift_right(_mix64_torch(stream + cols * _GOLDEN), 41)
    u = (bits.to(torch.float32) + 0.5) * (1.0 / 8388608.0)
    return -torch.log(-torch.log(u))


def _scaled(logits: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    z = logits.float()
    if temperature is None:
        return z
    t = temperature.float()
    return z / torch.where(t < GREEDY_TEMPERATURE, 1.0, t).unsqueeze(1)


# --------------------------------------------------------------------------- checks


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_logits(logits: torch.Tensor) -> None:
    _check(logits.dim() == 2, "logits must be [batch, vocab]")
    _check(logits.dtype in _FLOAT_DTYPES, f"logits dtype {logits.dtype} unsupported")
    _check(logits.stride(1) == 1, "logits rows must be contiguous")
    _check(0 < logits.shape[1] < 2**31, "vocab size out of range")


def _check_row_param(
    value: torch.Tensor | None, name: str, batch: int, device: torch.device
) -> None:
    if value is None:
        return
    _check(value.shape == (batch,), f"{name} must be [batch]")
    _check(value.is_contiguous(), f"{name} must be contiguous")
    _check(value.device == device, f"{name} is on {value.device}, logits on {device}")
