"""The Triton paged attention's per-layer options, a sliding window and a logit softcap,
against the torch reference (attention_ref.paged_attention with window= / softcap=), on the
CPU through Triton's interpreter (TRITON_INTERPRET=1: see test_triton_kernels.py for how the
interpreter is chosen and the fresh-process fallback; its make_step builds the steps).

The kernels run on copies of the caches whose keys and values before each request's first
window start are NaN (the reference reads the clean caches): a kernel that reads a key outside
every window of its program, in a tile it should skip or without its load mask, gives NaN.
Tolerances as test_triton_kernels.py's: fp32 2e-5, bf16 3e-2 absolute.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.interpreter import (
    fresh_process_test,
    interpret_triton,
    interpreted,
    skip_unless_interpreted,
)

IN_PROCESS = interpret_triton()

import torch  # noqa: E402

from pagedserve.kernels.attention_ref import paged_attention as reference_attention  # noqa: E402
from tests.test_triton_kernels import ATTENTION_ATOL, MIXED, make_step  # noqa: E402

ta = interpreted("pagedserve.kernels.triton_attention", "_prefill_kernel", IN_PROCESS)
_kernels_in_this_process = skip_unless_interpreted(IN_PROCESS)
test_kernels_in_a_fresh_interpreter_process = fresh_process_test(__file__, IN_PROCESS)


def poisoned_caches(step: dict, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the step's caches, NaN at every position of a request before
    ctx - window + 1 (its first query's window start; ctx = seq_len - q_len)."""
    k_cache, v_cache = step["k_cache"].clone(), step["v_cache"].clone()
    metadata = step["metadata"]
    block_size = k_cache.shape[1]
    lens = zip(metadata.query_lens_cpu.tolist(), metadata.seq_lens_cpu.tolist())
    for row, (q_len, seq_len) in enumerate(lens):
        positions = torch.arange(max(seq_len - q_len - window + 1, 0) if window else 0)
        blocks = metadata.block_tables_cpu[row, positions // block_size].long()
        for cache in (k_cache, v_cache):
            cache[blocks, positions % block_size] = float("nan")
    return k_cache, v_cache


def check_options(
    step: dict,
    window: int,
    softcap: float,
    num_splits: int | None = None,
    **launch: object,
) -> torch.Tensor:
    """The kernels (on the poisoned caches) against the reference; returns their output.
    `launch`: paged_attention's keyword arguments (prefill_tiles, longest_first)."""
    q, metadata = step["q"], step["metadata"]
    scale = q.shape[-1] ** -0.5
    k_cache, v_cache = poisoned_caches(step, window)
    out = ta.paged_attention(
        q,
        k_cache,
        v_cache,
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        metadata.max_query_len,
        scale,
        max_seq_len=metadata.max_seq_len,
        num_splits=num_splits,
        window=window,
        softcap=softcap,
        **launch,
    )
    caches = (step["k_cache"].float(), step["v_cache"].float())
    expected = reference_attention(
        q.float(), *caches, metadata, scale, window=window, softcap=softcap
    ).to(q.dtype)
    torch.testing.assert_close(out.float(), expected.float(), atol=ATTENTION_ATOL[q.dtype], rtol=0)
    return out


DECODES = [(c, 1) for c in (0, 2, 15, 16, 40, 79)]
# prefill chunks after earlier context (chunked prefill), a fresh prompt, a decode
CHUNKED = [(70, 10), (37, 20), (3, 2), (0, 30), (150, 9), (20, 1)]


@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("window", [1, 3, 10, 200])  # one key, < a block, blocks, > any context
def test_decode_window(window: int, softcap: float) -> None:
    """A decode-only batch, GQA 4, blocks of 4 tokens (the automatic split count: one)."""
    step = make_step(DECODES, 4, 8, 2, 32, torch.float32, seed=window)
    check_options(step, window, softcap)


@pytest.mark.parametrize(
    "window,softcap,num_splits,dtype",
    [
        (100, 0.0, 4, torch.float32),  # 3 tiles a window: 3 splits, empty ones for short requests
        (64, 5.0, 3, torch.bfloat16),
        (7, 0.0, 2, torch.float32),  # the window in one tile or two: the second split may be empty
        (1000, 5.0, 4, torch.float32),  # past every context: the splits over the whole context
        (100, 3.0, 1, torch.float32),  # one split: the decode kernel writes the output
    ],
)
def test_split_k_decode_window(
    window: int, softcap: float, num_splits: int, dtype: torch.dtype
) -> None:
    """Long contexts cut into splits of 64-key tiles, only the window's tiles shared out."""
    cases = [(300, 1), (129, 1), (40, 1), (5, 1), (0, 1)]
    step = make_step(cases, 16, 4, 2, 32, dtype, seed=window)
    check_options(step, window, softcap, num_splits)


@pytest.mark.parametrize(
    "block_size,tiles",
    [
        (4, (16, 16)),  # 8 queries x 2 heads a tile, 4 pages a key tile
        (16, (32, 16)),  # a key tile inside a page
    ],
)
@pytest.mark.parametrize(
    "window,softcap",
    [
        (1, 0.0),  # each query its own key
        (5, 0.0),  # < a query tile: the diagonal tiles only
        (24, 3.0),  # lower masked tiles, then unmasked and diagonal ones
        (500, 0.0),  # past every context: as no window
    ],
)
def test_chunked_prefill_window(
    block_size: int, tiles: tuple[int, int], window: int, softcap: float
) -> None:
    """Prefill chunks reading earlier context, under two tile configurations, longest first."""
    step = make_step(CHUNKED, block_size, 4, 2, 32, torch.float32, seed=window + block_size)
    prefill_tiles = ta.PrefillTiles(*tiles, num_warps=4, num_stages=2)
    check_options(step, window, softcap, prefill_tiles=prefill_tiles,
                  longest_first=step["metadata"].longest_first)  # fmt: skip


@pytest.mark.parametrize(
    "block_size,num_heads,num_kv_heads,head_dim,dtype,window,softcap",
    [
        (16, 8, 2, 32, torch.bfloat16, 5, 10.0),  # both, GQA 4, windows inside a block
        (4, 6, 2, 24, torch.float32, 19, 0.0),  # group 3, head_dim 24: padded rows and dims
        (16, 4, 4, 16, torch.float32, 0, 1.0),  # softcap alone, MHA
    ],
)
def test_mixed_batch_window_softcap(
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    window: int,
    softcap: float,
) -> None:
    """Fresh prompts, chunks after a cached prefix and decodes in one step (default tiles)."""
    step = make_step(MIXED, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=window)
    check_options(step, window, softcap)


def test_softcap_changes_the_scores() -> None:
    """A softcap of 1 on O(1) scores: far from the uncapped attention (the cap is applied)."""
    step = make_step(MIXED[:4], 4, 4, 2, 16, torch.float32, seed=3)
    capped = check_options(step, 0, 1.0)
    uncapped = check_options(step, 0, 0.0)
    assert (capped - uncapped).abs().max() > 0.05


def test_fp8_cache_backend_window_softcap() -> None:
    """paged_attention_backend's keywords; an fp8 cache: the softcap applies to the true score
    scale * k_scale * <q, k>, v_scale to the output."""
    step = make_step(MIXED, 4, 8, 2, 32, torch.float32, seed=8)
    k_scale, v_scale = 0.5, 2.0
    k_cache = (step["k_cache"] / k_scale).to(torch.float8_e4m3fn)
    v_cache = (step["v_cache"] / v_scale).to(torch.float8_e4m3fn)
    q, metadata = step["q"], step["metadata"]
    args = (q, k_cache, v_cache, metadata, 0.2, k_scale, v_scale)
    got = ta.paged_attention_backend(*args, window=9, softcap=3.0)
    expected = reference_attention(*args, window=9, softcap=3.0)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)


def tiles_read(monkeypatch: pytest.MonkeyPatch, tile_fn: str, run: Callable[[], object]) -> int:
    """How many key tiles the kernels' loops visit (calls of `tile_fn`) while run() runs."""
    calls = 0
    original = getattr(ta, tile_fn)

    def counted(*args: object) -> object:
        nonlocal calls
        calls += 1
        return original(*args)

    monkeypatch.setattr(ta, tile_fn, counted)
    run()
    return calls


@pytest.mark.parametrize(
    "window,num_splits,tiles",
    [
        (0, 1, 16),  # keys 0 .. 999 in 64-key tiles
        (10, 1, 1),  # keys 990 .. 999: tile 15
        (64, 1, 2),  # keys 936 .. 999: tiles 14, 15
        (200, 4, 4),  # keys 800 .. 999: tiles 12 .. 15 over 3 splits of 2 tiles
    ],
)
def test_decode_skips_the_tiles_before_the_window(
    monkeypatch: pytest.MonkeyPatch, window: int, num_splits: int, tiles: int
) -> None:
    step = make_step([(999, 1)], 16, 2, 1, 16, torch.float32, seed=1)
    run = lambda: check_options(step, window, 0.0, num_splits)
    assert tiles_read(monkeypatch, "_attend_tile", run) == tiles


@pytest.mark.parametrize(
    "window,tiles",
    [
        (0, 14),  # keys 0 .. 215 in 16-key tiles
        (8, 2),  # the queries' windows: keys 193 .. 215, tiles 12, 13
        (40, 4),  # keys 161 .. 215: tiles 10 .. 13 (11 unmasked)
    ],
)
def test_prefill_skips_the_tiles_before_the_window(
    monkeypatch: pytest.MonkeyPatch, window: int, tiles: int
) -> None:
    """One query tile (16 queries after 200 cached tokens, MHA), 16-key tiles."""
    step = make_step([(200, 16)], 16, 1, 1, 16, torch.float32, seed=2)
    prefill_tiles = ta.PrefillTiles(16, 16, num_warps=4, num_stages=2)
    run = lambda: check_options(step, window, 0.0, prefill_tiles=prefill_tiles)
    assert tiles_read(monkeypatch, "_prefill_tile", run) == tiles


def test_window_and_softcap_are_checked() -> None:
    step = make_step([(3, 2)], 4, 4, 2, 16, torch.float32, seed=1)
    q, k_cache, v_cache, md = step["q"], step["k_cache"], step["v_cache"], step["metadata"]
    args = (md.block_tables, md.seq_lens, md.query_start_loc, md.max_query_len, 1.0)
    for options in ({"window": -1}, {"softcap": -1.0}):
        with pytest.raises(ValueError, match="window and softcap"):
            ta.paged_attention(q, k_cache, v_cache, *args, **options)
