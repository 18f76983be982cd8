"""The Triton kernels against their pure-torch references, on the CPU through Triton's
interpreter (TRITON_INTERPRET=1), on fresh random inputs.

The interpreter is chosen when a `@triton.jit` function is decorated, triton.language's own
helpers (tl.sum, tl.max, ...) included, so TRITON_INTERPRET=1 must be set before triton is
first imported. Run alone (or first), this module sets it and runs the kernels in-process; it
then stays set for the session (Triton reads it again at launch; on a CPU a Triton kernel can
only run interpreted anyway). In a full session where something imported triton earlier
(torch._dynamo does, through other test modules), the in-process tests are skipped, the
variable is put back, and `test_kernels_in_a_fresh_interpreter_process` runs this file in a
fresh `python -m pytest` with the variable set.

Tolerances: fp32 attention 2e-5 absolute against the fp32 reference; bf16 attention 3e-2
absolute against the reference run in fp32 on the same bf16 inputs (P is rounded to bf16
before P @ V, as on tensor cores; outputs are O(1)). The small ops match the reference's
roundings step by step: fp16/bf16 within one unit in the last place, fp32 within 1e-5 rel.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import numpy as np
import pytest

_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton.language.standard as _tl_standard
    from triton.runtime.interpreter import InterpretedFunction
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"triton is not importable ({exc}): no kernel tests", allow_module_level=True)

import torch  # noqa: E402

from pagedserve.kernels import ops  # noqa: E402
from pagedserve.kernels.attention_metadata import (  # noqa: E402
    build_attention_metadata,
    cdiv,
    longest_first_order,
)
from pagedserve.kernels.attention_ref import paged_attention as reference_attention  # noqa: E402
from pagedserve.kernels.attention_ref import write_kv_cache as reference_write  # noqa: E402
from tests.interpreter import assert_passes_in_fresh_interpreter  # noqa: E402

IN_PROCESS = isinstance(_tl_standard.sum, InterpretedFunction)
NOT_IN_PROCESS = (
    "triton was imported before TRITON_INTERPRET=1 was set (compiled mode): the kernels run "
    "in test_kernels_in_a_fresh_interpreter_process instead"
)
if not IN_PROCESS:
    if _PREVIOUS_INTERPRET is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _PREVIOUS_INTERPRET


def _interpreted(name: str, kernel: str) -> ModuleType | None:
    """The kernel module `name`, its kernels interpreted (None when not IN_PROCESS)."""
    if not IN_PROCESS:
        return None
    module = importlib.import_module(name)
    assert isinstance(getattr(module, kernel), InterpretedFunction)
    return module


ta = _interpreted("pagedserve.kernels.triton_attention", "_prefill_kernel")
tops = _interpreted("pagedserve.kernels.triton_ops", "_rms_norm_kernel")
ts = _interpreted("pagedserve.kernels.triton_sampling", "_sample_kernel")
targ = _interpreted("pagedserve.kernels.triton_argmax", "_argmax_kernel")
tlora = _interpreted("pagedserve.kernels.triton_lora", "_shrink_kernel")


FRESH_PROCESS_TEST = "test_kernels_in_a_fresh_interpreter_process"


@pytest.fixture(autouse=True)
def _kernels_in_this_process(request: pytest.FixtureRequest) -> None:
    if not IN_PROCESS and request.node.originalname != FRESH_PROCESS_TEST:
        pytest.skip(NOT_IN_PROCESS)


def test_kernels_in_a_fresh_interpreter_process() -> None:
    """This file in a fresh process, when triton was imported too early to interpret here:
    every test must pass there (only this one skips)."""
    if IN_PROCESS:
        pytest.skip("the kernels run in this process")
    assert_passes_in_fresh_interpreter(__file__)


CPU = torch.device("cpu")
ATTENTION_ATOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
ULP = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


# --------------------------------------------------------------------------- attention


def make_step(
    cases: list[tuple[int, int]],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
) -> dict:
    """A step over requests (cached tokens, new tokens): shuffled non-contiguous block tables,
    caches holding every request's context (new tokens included), q for the new tokens."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [cdiv(ctx + new, block_size) for ctx, new in cases]
    num_blocks = sum(blocks_needed) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[pool.pop() for _ in range(n)] for n in blocks_needed]
    width = max(blocks_needed) + 1  # a spare column: tables are wider than needed
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    slot_mapping = torch.tensor(
        [
            tables[r][p // block_size] * block_size + p % block_size
            for r, (ctx, new) in enumerate(cases)
            for p in range(ctx, ctx + new)
        ]
    )
    num_tokens = len(slot_mapping)
    # q as a strided view of a fused qkv projection output
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q = qkv.to(dtype)[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    metadata = build_attention_metadata(
        torch.tensor([new for _, new in cases]),
        torch.tensor([ctx + new for ctx, new in cases]),
        block_tables,
        slot_mapping,
        block_size,
        CPU,
    )
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "metadata": metadata}


def check_attention(step: dict, num_splits: int | None = None, **launch: object) -> None:
    """`launch`: paged_attention's keyword arguments (prefill_tiles, longest_first)."""
    q, k_cache, v_cache, metadata = step["q"], step["k_cache"], step["v_cache"], step["metadata"]
    scale = q.shape[-1] ** -0.5
    out = ta.paged_attention(
        q,
        k_cache,
        v_cache,
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        metadata.max_query_len,
        scale,
        num_splits=num_splits,
        **launch,
    )
    expected = reference_attention(q.float(), k_cache.float(), v_cache.float(), metadata, scale).to(
        q.dtype
    )
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=ATTENTION_ATOL[q.dtype], rtol=0)


MIXED = [(0, 7), (40, 1), (0, 1), (33, 20), (5, 1), (17, 16), (0, 45), (64, 1)]


@pytest.mark.parametrize(
    "block_size,num_heads,num_kv_heads,head_dim,dtype",
    [
        (4, 4, 4, 32, torch.float32),  # MHA
        (16, 8, 2, 32, torch.bfloat16),  # GQA 4
        (1, 4, 2, 16, torch.float32),  # GQA 2, one-token blocks
        (16, 8, 4, 16, torch.bfloat16),
        (4, 6, 2, 24, torch.float32),  # group 3 and head_dim 24: padded rows and dims
    ],
)
def test_paged_attention_mixed_batch(
    block_size: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """Prefill chunks reading earlier context from the cache, fresh prompts and decodes."""
    step = make_step(MIXED, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=block_size)
    check_attention(step)


def test_paged_attention_prefill_only() -> None:
    """A long chunk (several query tiles and key tiles) and its neighbours, no decode."""
    step = make_step([(70, 10), (0, 80), (3, 2)], 16, 4, 1, 32, torch.float32, seed=5)
    check_attention(step)


# requests of very different lengths: fresh prompts, chunks after a cached prefix (q_len <
# kv_len), a decode (left to the decode kernel), a two-token chunk
PREFILL_CASES = [(0, 150), (37, 3), (200, 41), (5, 1), (0, 9), (61, 64), (90, 2)]


@pytest.mark.parametrize(
    "block_size,block_m,block_n,dtype",
    [
        (4, 16, 16, torch.float32),  # 4 pages a key tile; 8 queries a tile, diagonal in 1-2 tiles
        (16, 32, 16, torch.bfloat16),  # a key tile inside a page
        (8, 64, 32, torch.float32),  # 32 queries a tile: the diagonal spans 2-3 key tiles
        (12, 16, 32, torch.float32),  # pages and tiles not multiples: one table entry per key
        (1, 16, 64, torch.float32),  # one-token pages
    ],
)
@pytest.mark.parametrize("ordered", [True, False])
def test_prefill_tiles_match_the_reference(
    block_size: int, block_m: int, block_n: int, dtype: torch.dtype, ordered: bool
) -> None:
    """The prefill kernel under several launch configurations (query rows x keys, pages not
    aligned with key tiles), in the longest-first order of the step or in batch order."""
    step = make_step(PREFILL_CASES, block_size, 4, 2, 32, dtype, seed=block_size + block_m)
    tiles = ta.PrefillTiles(block_m, block_n, num_warps=4, num_stages=2)
    order = step["metadata"].longest_first if ordered else None
    check_attention(step, prefill_tiles=tiles, longest_first=order)


def test_longest_first_order_puts_the_longest_contexts_first() -> None:
    query_lens = torch.tensor([3, 100, 1, 40])
    seq_lens = torch.tensor([50, 100, 300, 100])
    order = longest_first_order(query_lens, seq_lens)
    assert order.dtype == torch.int32
    assert order.tolist() == [2, 1, 3, 0] + [0, 1, 101, 141, 144]


def test_prefill_tiles_are_checked() -> None:
    step = make_step([(3, 20)], 4, 8, 2, 16, torch.float32, seed=2)
    q, k_cache, v_cache, md = step["q"], step["k_cache"], step["v_cache"], step["metadata"]
    args = (md.block_tables, md.seq_lens, md.query_start_loc, md.max_query_len, 1.0)
    for tiles, match in [
        (ta.PrefillTiles(48, 16, 4, 2), "block_m must be a power of two"),
        (ta.PrefillTiles(16, 8, 4, 2), "block_n must be a power of two >= 16"),
        (ta.PrefillTiles(16, 16, 0, 2), "num_warps"),
    ]:
        with pytest.raises(ValueError, match=match):
            ta.paged_attention(q, k_cache, v_cache, *args, prefill_tiles=tiles)
    with pytest.raises(ValueError, match="longest_first"):
        ta.paged_attention(q, k_cache, v_cache, *args, longest_first=md.query_start_loc)


@pytest.mark.parametrize(
    "block_size,num_heads,num_kv_heads,dtype,num_splits",
    [
        (16, 4, 4, torch.float32, None),  # automatic split count (CPU: as for 4 SMs)
        (4, 8, 4, torch.float32, 1),  # no split: the decode kernel writes the output
        (1, 8, 2, torch.bfloat16, 3),  # split-K + reduce, one-token blocks
        (16, 8, 2, torch.float32, 2),
        (4, 16, 4, torch.bfloat16, 64),  # more splits than tiles: clamped
    ],
)
def test_paged_attention_decode(
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    num_splits: int | None,
) -> None:
    cases = [(c, 1) for c in (0, 3, 15, 16, 63, 64, 79)]
    step = make_step(cases, block_size, num_heads, num_kv_heads, 32, dtype, seed=num_heads)
    check_attention(step, num_splits)


def test_paged_attention_decode_reduces_more_splits_than_one_chunk() -> None:
    """40 splits: the reduce kernel reads them in two chunks of 32 (and empty splits for
    the short request)."""
    step = make_step([(2400, 1), (40, 1)], 16, 4, 2, 32, torch.float32, seed=11)
    check_attention(step, num_splits=40)


def test_paged_attention_backend_and_out() -> None:
    """The metadata adapter (attention_backends.AttentionFn) and a caller-provided `out`."""
    step = make_step([(20, 1), (50, 1), (0, 1)], 4, 4, 2, 16, torch.float32, seed=9)
    q, k_cache, v_cache, metadata = step["q"], step["k_cache"], step["v_cache"], step["metadata"]
    expected = reference_attention(q, k_cache, v_cache, metadata, 0.3)
    got = ta.paged_attention_backend(q, k_cache, v_cache, metadata, 0.3)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)
    out = torch.full_like(q, float("nan"))
    ta.paged_attention(
        q,
        k_cache,
        v_cache,
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        1,
        0.3,
        out=out,
        max_seq_len=metadata.max_seq_len,
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)


def test_paged_attention_rejects_bad_arguments() -> None:
    step = make_step([(3, 2)], 4, 4, 2, 16, torch.float32, seed=1)
    q, k_cache, v_cache, md = step["q"], step["k_cache"], step["v_cache"], step["metadata"]
    args = (md.block_tables, md.seq_lens, md.query_start_loc, md.max_query_len, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        ta.paged_attention(q.double(), k_cache, v_cache, *args)
    with pytest.raises(ValueError, match="multiple"):
        ta.paged_attention(q[:, :3], k_cache, v_cache, *args)
    with pytest.raises(ValueError, match="int32"):
        ta.paged_attention(q, k_cache, v_cache, md.block_tables.long(), *args[1:])
    with pytest.raises(ValueError, match="one token a request"):
        ta.paged_attention(q, k_cache, v_cache, *args[:3], 1, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_write_kv_cache(dtype: torch.dtype, block_size: int, index_dtype: torch.dtype) -> None:
    """Shuffled slots with -1 padding rows; key/value as strided views of a qkv output."""
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim, num_tokens = 24, 2, 32, 19
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:4]] = -1
    kv = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = kv[:, 1], kv[:, 2]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    real = slots >= 0
    reference_write(key[real], value[real], expected_k, expected_v, slots[real])
    ta.write_kv_cache(key, value, k_cache, v_cache, slots.to(index_dtype))
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_write_kv_cache_rejects_bad_arguments() -> None:
    cache = torch.zeros(2, 4, 2, 16)
    key = torch.zeros(3, 2, 16)
    with pytest.raises(ValueError, match="dtype"):
        ta.write_kv_cache(key.half(), key.half(), cache, cache, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="slot_mapping"):
        ta.write_kv_cache(key, key, cache, cache, torch.zeros(2, dtype=torch.long))


# --------------------------------------------------------------------------- small ops

OP_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_ulp_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    ulp = ULP[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=ulp, atol=ulp * 1e-3)


@pytest.mark.parametrize("dtype", OP_DTYPES)
def test_rms_norm(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 96, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    assert_ulp_close(tops.rms_norm(x, weight, 1e-6), ops.rms_norm(x, weight, 1e-6))
    weight32 = weight.float()  # fp32 weight on low-precision activations: an fp32 result
    assert_ulp_close(tops.rms_norm(x, weight32, 1e-5), ops.rms_norm(x, weight32, 1e-5))


@pytest.mark.parametrize("dtype", OP_DTYPES)
@pytest.mark.parametrize("inplace", [False, True])
def test_fused_add_rms_norm(dtype: torch.dtype, inplace: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 80, generator=gen).to(dtype)
    residual = torch.randn(7, 80, generator=gen).to(dtype)
    weight = torch.randn(80, generator=gen).to(dtype)
    expected, expected_residual = ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    normed, new_residual = tops.fused_add_rms_norm(x, residual, weight, 1e-6, inplace=inplace)
    assert_ulp_close(normed, expected)
    assert torch.equal(new_residual, expected_residual)  # one rounding of an exact sum
    if inplace:
        assert normed.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()


@pytest.mark.parametrize("dtype", OP_DTYPES)
def test_apply_rotary(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    num_tokens, num_heads, num_kv_heads, head_dim = 9, 4, 2, 32
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 64, (num_tokens,), generator=gen)
    angles = torch.arange(64.0)[:, None] * 0.3 ** torch.arange(head_dim // 2.0)[None, :]
    cos_cache, sin_cache = angles.cos().to(dtype), angles.sin().to(dtype)
    cos, sin = cos_cache[positions], sin_cache[positions]
    expected_q, expected_k = ops.apply_rotary(q, cos, sin), ops.apply_rotary(k, cos, sin)
    assert_ulp_close(tops.apply_rotary(q, cos, sin), expected_q)
    got_q, got_k = tops.apply_rotary_qk(q, k, positions, cos_cache, sin_cache)
    assert_ulp_close(got_q, expected_q)
    assert_ulp_close(got_k, expected_k)
    got_q, got_k = tops.apply_rotary_qk(q, k, positions, cos_cache, sin_cache, inplace=True)
    assert got_q.data_ptr() == qkv.data_ptr()
    assert_ulp_close(q, expected_q)
    assert_ulp_close(k, expected_k)


def rotary_caches(head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[64, head_dim // 2] cos / sin caches of a rotary embedding (64 positions)."""
    angles = torch.arange(64.0)[:, None] * 0.3 ** torch.arange(head_dim // 2.0)[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,rotary_dim,index_dtype",
    [
        (4, 2, 64, 64, torch.int64),  # GQA 2
        (4, 2, 128, 128, torch.int32),
        (6, 1, 24, 24, torch.int64),  # 7 heads, head_dim 24: padded head rows and columns
        (4, 2, 32, 24, torch.int64),  # partial rotary (Phi-4-mini's 0.75): 8 dims kept
        (6, 1, 24, 8, torch.int32),  # partial, 16 dims kept: padded rotated columns
    ],
)
def test_qk_norm_rotary(
    dtype: torch.dtype,
    norm: bool,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    index_dtype: torch.dtype,
) -> None:
    """In place on qk, a strided view of a fused qkv buffer (with spare columns beyond v):
    q and k match the reference, v and the spare columns are untouched."""
    gen = torch.Generator().manual_seed(head_dim + norm)
    num_tokens, qk_width = 7, (num_heads + num_kv_heads) * head_dim
    width = qk_width + num_kv_heads * head_dim
    buffer = (2 * torch.randn(num_tokens, width + 8, generator=gen)).to(dtype)
    qk = buffer[:, :width][:, :qk_width].view(num_tokens, num_heads + num_kv_heads, head_dim)
    positions = torch.randint(0, 64, (num_tokens,), generator=gen).to(index_dtype)
    positions[-1] = positions[0]  # a repeated position
    cos_cache, sin_cache = rotary_caches(rotary_dim, dtype)
    weights = (None, None)
    if norm:
        weights = tuple((1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype) for _ in "qk")
    expected = ops.qk_norm_rotary(qk, positions, cos_cache, sin_cache, *weights, 1e-6,
                                  num_q_heads=num_heads, rotary_dim=rotary_dim)  # fmt: skip
    if norm:  # the norm really ran: rotary alone differs
        rotary_only = ops.qk_norm_rotary(qk, positions, cos_cache, sin_cache,
                                         rotary_dim=rotary_dim)  # fmt: skip
        assert not torch.allclose(expected, rotary_only)
    untouched = buffer[:, qk_width:].clone()
    got = tops.qk_norm_rotary_(qk, positions, cos_cache, sin_cache, *weights, 1e-6,
                               num_q_heads=num_heads, rotary_dim=rotary_dim)  # fmt: skip
    assert got is qk
    if norm and rotary_dim < head_dim:
        # the kernel sums the squares in three parts (the rotated halves, the kept dims), so
        # its inv_rms may differ from torch's by a rounding; rotary's differences of O(1)
        # products then show it absolutely, up to a few fp32 ulps of those products
        ulp = ULP[dtype]
        torch.testing.assert_close(qk.float(), expected.float(), rtol=ulp, atol=ulp * 0.1)
    else:
        assert_ulp_close(qk, expected)
    assert torch.equal(buffer[:, qk_width:], untouched)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,norm,rotary_dim",
    [(4, 2, 64, 16, True, 64), (6, 3, 24, 4, False, 24), (4, 1, 32, 1, True, 32),
     (4, 2, 32, 4, True, 24), (6, 3, 24, 4, False, 16)],  # the last two: partial rotary
)  # fmt: skip
def test_qk_norm_rotary_writes_the_kv_cache(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    norm: bool, rotary_dim: int,
) -> None:  # fmt: skip
    """kv_write: one launch gives what qk_norm_rotary_ then write_kv_cache give (the rotated
    k and the untouched v in the paged caches at each token's slot; -1 slots skipped)."""
    gen = torch.Generator().manual_seed(head_dim + block_size)
    num_tokens, num_blocks = 9, 12
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (2 * torch.randn(num_tokens, width, generator=gen)).to(dtype)
    qk_width = (num_heads + num_kv_heads) * head_dim
    positions = torch.randint(0, 64, (num_tokens,), generator=gen)
    cos_cache, sin_cache = rotary_caches(rotary_dim, dtype)
    weights = (None, None)
    if norm:
        weights = tuple((1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype) for _ in "qk")
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in "kv"]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:2]] = -1

    def split(buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qk = buffer[:, :qk_width].view(num_tokens, num_heads + num_kv_heads, head_dim)
        return qk, buffer[:, qk_width:].view(num_tokens, num_kv_heads, head_dim)

    expected_qkv, expected_caches = qkv.clone(), [c.clone() for c in caches]
    qk, v = split(expected_qkv)
    tops.qk_norm_rotary_(qk, positions, cos_cache, sin_cache, *weights, 1e-6,
                         num_q_heads=num_heads, rotary_dim=rotary_dim)  # fmt: skip
    ta.write_kv_cache(qk[:, num_heads:], v, *expected_caches, slots)
    qk, v = split(qkv)
    write = tops.KVWrite(v, caches[0], caches[1], slots)
    tops.qk_norm_rotary_(qk, positions, cos_cache, sin_cache, *weights, 1e-6,
                         num_q_heads=num_heads, kv_write=write, rotary_dim=rotary_dim)  # fmt: skip
    assert torch.equal(qkv, expected_qkv)
    assert torch.equal(caches[0], expected_caches[0]) and torch.equal(caches[1], expected_caches[1])
    with pytest.raises(ValueError, match="kv_write.v must be"):
        bad = tops.KVWrite(v[:-1], caches[0], caches[1], slots)
        tops.qk_norm_rotary_(qk, positions, cos_cache, sin_cache, num_q_heads=num_heads,
                             kv_write=bad, rotary_dim=rotary_dim)  # fmt: skip


def test_qk_norm_rotary_single_token_and_empty() -> None:
    """A decode step of one token (any row stride), and no tokens at all."""
    cos_cache, sin_cache = rotary_caches(32, torch.float32)
    qk = torch.randn(1, 3, 32, generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([17])
    weight = torch.rand(32) + 0.5
    expected = ops.qk_norm_rotary(qk, positions, cos_cache, sin_cache, weight, 2 * weight,
                                  1e-5, num_q_heads=2)  # fmt: skip
    tops.qk_norm_rotary_(qk, positions, cos_cache, sin_cache, weight, 2 * weight, 1e-5,
                         num_q_heads=2)  # fmt: skip
    assert_ulp_close(qk, expected)
    empty = torch.empty(0, 3, 32)
    assert tops.qk_norm_rotary_(empty, positions[:0], cos_cache, sin_cache) is empty


def test_qk_norm_rotary_rejects_bad_arguments() -> None:
    cos, sin = rotary_caches(16, torch.float32)
    qkv = torch.zeros(3, 4 * 16)
    qk = qkv[:, : 3 * 16].view(3, 3, 16)
    pos = torch.zeros(3, dtype=torch.long)
    w = torch.ones(16)
    bf16 = torch.bfloat16
    bad_calls: list[tuple[str, tuple, dict]] = [
        ("num_tokens, num_heads, head_dim", (qkv, pos, cos, sin), {}),
        ("packed", (qkv.view(3, 4, 16)[:, ::2], pos, cos, sin), {}),
        ("overlap", (torch.zeros(1, 3, 16).expand(3, 3, 16), pos, cos, sin), {}),
        ("head_dim // 2", (qk, pos, cos[:, :4], sin[:, :4]), {}),
        ("head_dim // 2", (qk, pos, cos, sin), {"rotary_dim": 8}),  # caches of all 16 dims
        ("rotary_dim must be even", (qk, pos, cos[:, :3], sin[:, :3]), {"rotary_dim": 7}),
        ("rotary_dim must be even", (qk, pos, cos, sin), {"rotary_dim": 18}),
        ("promote", (qk.to(bf16), pos, cos, sin), {}),  # an fp32 cache on a bf16 qk
        ("positions must be", (qk, pos[:2], cos, sin), {}),
        ("int32 or int64", (qk, pos.float(), cos, sin), {}),
        ("both", (qk, pos, cos, sin, w), {"num_q_heads": 2}),
        ("num_q_heads", (qk, pos, cos, sin, w, w), {}),
        ("num_q_heads", (qk, pos, cos, sin, w, w), {"num_q_heads": 4}),
        ("k_weight must be", (qk, pos, cos, sin, w, w[:8]), {"num_q_heads": 2}),
        ("q_weight dtype", (qk, pos, cos, sin, w.long(), w), {"num_q_heads": 2}),
        ("promote", (qk.to(bf16), pos, cos.to(bf16), sin.to(bf16), w, w), {"num_q_heads": 2}),
    ]
    for message, args, kwargs in bad_calls:
        with pytest.raises(ValueError, match=message):
            tops.qk_norm_rotary_(*args, **kwargs)
    assert torch.equal(qkv, torch.zeros_like(qkv))


@pytest.mark.parametrize("dtype", OP_DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(3, 4, 2 * 72, generator=gen)).to(dtype)
    assert_ulp_close(tops.silu_and_mul(x), ops.silu_and_mul(x))


def test_ops_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="weight"):
        tops.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="even"):
        tops.silu_and_mul(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="head_dim // 2"):
        tops.apply_rotary(torch.zeros(2, 1, 8), torch.zeros(2, 3), torch.zeros(2, 3))


# --------------------------------------------------------------------------- sampling

VOCAB = 700  # several 256-wide chunks, one of them partial
ROW_SETTINGS = [  # (top_k, top_p, temperature, min_p)
    (0, 1.0, 1.0, 0.0),  # no filter
    (5, 1.0, 0.5, 0.0),  # top-k only
    (50, 0.9, 2.0, 0.0),  # both
    (699, 0.5, 1.0, 0.0),
    (VOCAB, 1.0, 1.0, 0.1),  # k >= vocab (off), min-p
    (1, 0.3, 1.0, 0.0),  # k = 1
    (20, 0.99, 0.7, 0.0),
    (0, 0.1, 1.3, 0.0),  # top-p only
    (0, 0.0, 1.0, 0.0),  # p = 0: the top token only
    (100, 0.95, 1.0, 0.05),
    (-1, 0.8, 0.0, 0.0),  # greedy temperature (filters see temperature 1)
    (3, 1.0, 1.0, 0.5),
]


def row_params() -> tuple[torch.Tensor, ...]:
    top_k, top_p, temperature, min_p = zip(*ROW_SETTINGS)
    return (
        torch.tensor(top_k),
        torch.tensor(top_p),
        torch.tensor(temperature),
        torch.tensor(min_p),
    )


@pytest.mark.parametrize(
    "dtype,candidates",
    [
        (torch.float32, 0),  # the search kernel for every row
        (torch.bfloat16, 0),
        (torch.float32, 64),  # topk candidates; rows beyond them fall back to the kernel
        (torch.float32, 256),
    ],
)
def test_sampling_thresholds_match_sorted_support(dtype: torch.dtype, candidates: int) -> None:
    gen = torch.Generator().manual_seed(4)
    logits = (3 * torch.randn(len(ROW_SETTINGS), VOCAB, generator=gen)).to(dtype)
    logits[2, :100] = float("-inf")  # masked-out vocabulary entries
    top_k, top_p, temperature, min_p = row_params()
    thresholds = ts.sampling_thresholds(
        logits, temperature, top_k, top_p, min_p, candidates=candidates
    )
    keep = ts._scaled(logits, temperature) >= thresholds.unsqueeze(1)
    expected = ts.reference_keep_mask(logits, temperature, top_k, top_p, min_p)
    # Exact, except that a value tied with the reference's smallest kept value (bf16 has
    # ties) is always kept here, where the sort keeps an arbitrary subset of the tied tokens.
    z = ts._scaled(logits, temperature)
    boundary = z.masked_fill(~expected, float("inf")).amin(dim=1, keepdim=True)
    assert torch.equal(keep & (z != boundary), expected & (z != boundary))
    assert (keep | ~expected).all()
    if dtype == torch.float32:
        assert torch.equal(keep, expected), (keep != expected).sum(dim=1).tolist()
    if candidates == 64:  # both paths ran: rows settled by the candidates, rows left to the kernel
        _, resolved = ts._candidate_thresholds(logits, temperature, top_k, top_p, min_p, 64)
        assert resolved.any() and not resolved.all()
    assert expected.sum(dim=1).tolist()[:2] == [VOCAB, 5]


def test_apply_top_k_top_p_matches_the_torch_sampler() -> None:
    sampler = pytest.importorskip("pagedserve.actors.worker.sampler")
    gen = torch.Generator().manual_seed(5)
    logits = 2 * torch.randn(len(ROW_SETTINGS), VOCAB, generator=gen)
    top_k, top_p, _, _ = row_params()
    got = ts.apply_top_k_top_p(logits, top_k, top_p)
    sampler_k = torch.where(top_k <= 0, VOCAB, top_k)  # the sampler's 'off' is k >= vocab
    expected = sampler.apply_top_k_top_p(logits, sampler_k, top_p)
    assert torch.equal(got.isinf(), expected.isinf())
    assert torch.equal(got[~got.isinf()], logits[~got.isinf()])


@pytest.mark.parametrize(
    "top_k,top_p,temperature,min_p",
    [(0, 1.0, 1.0, 0.0), (6, 0.8, 0.7, 0.0), (0, 0.9, 1.5, 0.1)],
)
def test_sample_distribution(top_k: int, top_p: float, temperature: float, min_p: float) -> None:
    """4000 draws from one row (distinct seeds): never outside the support, and a chi-square
    test against the sorted reference's probabilities (fixed seeds: deterministic)."""
    draws, vocab = 4000, 10
    gen = torch.Generator().manual_seed(6)
    row = 1.5 * torch.randn(1, vocab, generator=gen)
    params = [torch.tensor([v]) for v in (top_k, top_p, temperature, min_p)]
    k, p, t, mp = params
    thresholds = ts.sampling_thresholds(row, t, k, p, mp)
    probs = ts.reference_probs(row, t, k, p, mp)[0]
    ids = ts.sample_from_logits(
        row.expand(draws, vocab).contiguous(),
        t.expand(draws).contiguous(),
        torch.arange(draws) * 7919,
        thresholds=thresholds.expand(draws).contiguous(),
    )
    counts = torch.bincount(ids, minlength=vocab).double()
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = probs[support] * draws
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < 30.0, (chi2, counts.tolist(), expected.tolist())  # df <= 9: p < 5e-4


@pytest.mark.parametrize("vocab_splits", [1, 3])
def test_sample_support_greedy_and_seeds(vocab_splits: int) -> None:
    gen = torch.Generator().manual_seed(7)
    logits = 3 * torch.randn(len(ROW_SETTINGS), VOCAB, generator=gen)
    top_k, top_p, temperature, min_p = row_params()
    seeds = torch.randint(0, 2**62, (len(ROW_SETTINGS),), generator=gen)
    offsets = torch.arange(len(ROW_SETTINGS)) * 3
    ids = ts.sample_from_logits(
        logits, temperature, seeds, offsets, top_k, top_p, min_p, vocab_splits=vocab_splits
    )
    keep = ts.reference_keep_mask(logits, temperature, top_k, top_p, min_p)
    assert keep.gather(1, ids.unsqueeze(1)).all()
    greedy = temperature < ts.GREEDY_TEMPERATURE
    assert torch.equal(ids[greedy], logits[greedy].argmax(dim=1))
    # a row's draw depends on (seed, offset) only, not on its position or batch neighbours
    order = torch.randperm(len(ROW_SETTINGS), generator=gen)
    again = ts.sample_from_logits(
        logits[order],
        temperature[order],
        seeds[order],
        offsets[order],
        top_k[order],
        top_p[order],
        min_p[order],
        vocab_splits=vocab_splits,
    )
    assert torch.equal(again, ids[order])
    # fresh offsets give fresh draws
    plain = torch.ones(64)
    flat = torch.zeros(64, VOCAB)
    first = ts.sample_from_logits(flat, plain, torch.full((64,), 11), torch.zeros(64, dtype=int))
    second = ts.sample_from_logits(flat, plain, torch.full((64,), 11), torch.arange(64))
    assert len(set(second.tolist())) > 40 and len(set(first.tolist())) == 1


def test_sampling_rejects_bad_arguments() -> None:
    logits = torch.zeros(2, 10)
    with pytest.raises(ValueError, match="top_k"):
        ts.sampling_thresholds(logits, top_k=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="seeds"):
        ts.sample_from_logits(logits, torch.ones(2), torch.zeros(2))


def test_vocab_splits_give_the_same_draws() -> None:
    """Splitting a row over several programs changes nothing: the noise is per (seed, i)."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(5, 3000, generator=gen)
    temperature = torch.tensor([1.0, 0.5, 0.0, 2.0, 1.0])
    seeds = torch.randint(0, 2**40, (5,), generator=gen)
    top_p = torch.tensor([0.9, 1.0, 1.0, 0.5, 0.99])
    ids = [
        ts.sample_from_logits(logits, temperature, seeds, top_p=top_p, vocab_splits=splits)
        for splits in (1, 2, 3)
    ]
    assert torch.equal(ids[0], ids[1]) and torch.equal(ids[0], ids[2])


# --------------------------------------------------------------------------- greedy argmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 20_000), (3, 5_000), (9, 3_000), (2, 700)])
def test_greedy_argmax_matches_torch(dtype: torch.dtype, rows: int, vocab: int) -> None:
    """Split over programs (one row of 20,000 columns: 7 splits) or not (9 rows), padded row
    stride: torch.argmax's indices, also on a second launch (the counters were reset)."""
    gen = torch.Generator().manual_seed(rows * vocab)
    wide = torch.randn(rows, vocab + 64, generator=gen).to(dtype)
    logits = wide[:, :vocab]
    for _ in range(2):
        out = targ.greedy_argmax(logits, torch.full((rows,), -1, dtype=torch.int64))
        assert torch.equal(out, logits.argmax(dim=-1))


def test_greedy_argmax_takes_the_first_of_equal_maxima() -> None:
    """Ties inside a step, across steps and across splits keep the first index; a constant row,
    a row of -inf and a row holding NaN give torch.argmax's index (NaN counts as the maximum)."""
    vocab = 20_000
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(3))
    logits[0, [17_000, 9_000, 9_001, 4_100]] = 50.0  # four splits apart, the first at 4,100
    logits[1] = 1.0
    logits[2] = -float("inf")
    logits[3, [12_345, 15_000]] = float("nan")
    logits[4, [3_000, 3_001]] = 7.0  # one step
    rows = [logits[i : i + 1] for i in range(5)]  # one row: the split launch
    got = [targ.greedy_argmax(r, torch.empty(1, dtype=torch.int64)).item() for r in rows]
    assert got == [4_100, 0, 0, 12_345, 3_000]
    assert got == logits.argmax(dim=-1).tolist() == targ.reference_argmax(logits).tolist()


def test_greedy_argmax_rejects_bad_arguments() -> None:
    logits = torch.zeros(2, 10)
    with pytest.raises(ValueError, match="int64"):
        targ.greedy_argmax(logits, torch.empty(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="unit column stride"):
        targ.greedy_argmax(logits.t(), torch.empty(10, dtype=torch.int64))
    with pytest.raises(ValueError, match="empty vocabulary"):
        targ.greedy_argmax(torch.zeros(2, 0), torch.empty(2, dtype=torch.int64))


def _sorted_by_slot(slots: list[int], num_slots: int, capacity: int):
    from pagedserve.models.lora import tokens_by_slot

    meta = torch.from_numpy(tokens_by_slot(np.array(slots), num_slots, capacity))
    return meta[:capacity], meta[capacity:]


def test_tokens_by_slot_sorts_the_adapters_tokens_and_counts_each_slot() -> None:
    order, starts = _sorted_by_slot([2, -1, 0, 0, 1, -1, 2], 4, 9)
    assert order.tolist() == [2, 3, 4, 0, 6, 0, 0, 0, 0]  # stable, padded
    assert starts.tolist() == [0, 2, 3, 5, 5]  # slot 3: none


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("part_sizes, rank", [([48], 16), ([40, 24], 32), ([64, 16, 16], 16)])
@pytest.mark.parametrize("tokens", [7, 40])  # a small step (K split over programs), a larger
def test_lora_delta_matches_the_reference(
    dtype: torch.dtype, part_sizes: list[int], rank: int, tokens: int
) -> None:
    """Tokens of three slots and none, K not a multiple of the column block, fused parts of
    unequal sizes (a column block holding two parts): y + the reference delta (fp32), within
    the output dtype's rounding; tokens without an adapter keep y bit for bit."""
    gen = torch.Generator().manual_seed(rank + len(part_sizes) + tokens)
    k, slots_n, n = 300, 3, sum(part_sizes)
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    a = (torch.randn(slots_n, len(part_sizes), rank, k, generator=gen) * 0.1).to(dtype)
    b = (torch.randn(slots_n, n, rank, generator=gen) * 0.1).to(dtype)
    slots = torch.tensor(([2, -1, 0, 0, 1, -1, 2] * 6)[:tokens])
    y = torch.randn(tokens, n, generator=gen).to(dtype)
    want = y.float() + tlora.reference_lora_delta(x, a, b, slots, part_sizes)
    got = y.clone()
    order, starts = _sorted_by_slot(slots.tolist(), slots_n, tokens + 3)
    tlora.add_lora_delta(x, got, a, b, order, starts, part_sizes)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got.float(), want, atol=tol, rtol=tol)
    untouched = slots < 0
    assert torch.equal(got[untouched], y[untouched])


def test_lora_delta_rejects_bad_arguments() -> None:
    x, y = torch.zeros(2, 8), torch.zeros(2, 16)
    a, b = torch.zeros(1, 1, 16, 8), torch.zeros(1, 16, 16)
    order, starts = _sorted_by_slot([0, -1], 1, 2)
    tlora.add_lora_delta(x, y, a, b, order, starts, [16])  # fits
    with pytest.raises(ValueError, match="power-of-two rank"):
        tlora.add_lora_delta(x, y, a[:, :, :12], b[:, :, :12].contiguous(), order, starts, [16])
    with pytest.raises(ValueError, match="int32"):
        tlora.add_lora_delta(x, y, a, b, order.long(), starts, [16])
    with pytest.raises(ValueError, match="does not fit"):
        tlora.add_lora_delta(x, y, a, b, order, starts, [8, 8])
    with pytest.raises(ValueError, match="order needs"):
        tlora.add_lora_delta(x, y, a, b, order[:1], starts, [16])


def test_lora_kernels_in_the_model_runner(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's LoRA path, run by the model runner on the CPU through the interpreter: each
    token's adapter slot in the buffer the kernels read (lora_slots.py fills it per step) and
    the shrink / expand kernels in every projection; requests 0 and 2 run with an adapter and
    give the merged model's greedy tokens, request 1 the base model's."""
    from pagedserve.actors.messages import LoRARequest
    from tests import mini_scheduler
    from tests.tiny_models import (
        hf_greedy,
        load_hf_model,
        merge_lora,
        save_lora_adapter,
        save_tiny_model,
    )

    monkeypatch.setattr(mini_scheduler, "MAX_NEW_TOKENS", 6)
    base = save_tiny_model("llama", tmp_path / "base")
    adapter = save_lora_adapter(base, tmp_path / "adapter", seed=1)
    runner = mini_scheduler.make_runner(base, enable_lora=True, max_lora_rank=8)
    runner.lora_slots.use_kernels(64)  # as on a GPU
    lora, execute = LoRARequest("a", 1, str(adapter)), runner.execute

    def with_adapter(plan):
        for data in plan.new_requests:
            data.lora = lora if data.handle in (0, 2) else None
        return execute(plan)

    runner.execute = with_adapter
    prompts = [[5, 17, 99, 3, 42] * 3, [7] * 9, list(range(30, 52))]
    params = mini_scheduler.SamplingParams(temperature=0.0, logprobs=0, max_tokens=6)
    requests = mini_scheduler.MiniScheduler(prompts, params).run(runner)
    merged, plain = merge_lora(base, adapter), load_hf_model(base)
    for request, prompt in zip(requests, prompts):
        model = merged if request.handle in (0, 2) else plain
        assert request.outputs == hf_greedy(model, prompt, 6)[0], request.handle
