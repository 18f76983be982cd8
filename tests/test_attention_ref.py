"""The torch paged-attention reference against a naive dense causal attention."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.attention import (
    build_attention_metadata,
    cdiv,
    paged_attention,
    write_kv_cache,
)

HEAD_DIM = 32


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_start: int, scale: float
) -> torch.Tensor:
    """q [n, H, D] at positions context_start.., k/v [context_start + n, Hkv, D], float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    query_pos = context_start + torch.arange(q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_case(
    cases: list[tuple[int, int]], block_size: int, num_heads: int, num_kv_heads: int, seed: int
) -> None:
    """cases: (tokens already in the cache, new tokens this step) per request."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [cdiv(ctx + new, block_size) for ctx, new in cases]
    num_blocks = sum(blocks_needed) + 3
    shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    pool = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled, non-contiguous
    tables = [[pool.pop() for _ in range(n)] for n in blocks_needed]
    width = max(blocks_needed)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    keys = [torch.randn(c + n, num_kv_heads, HEAD_DIM, generator=gen) for c, n in cases]
    values = [torch.randn(c + n, num_kv_heads, HEAD_DIM, generator=gen) for c, n in cases]

    def slots(r: int, positions: range) -> list[int]:
        return [tables[r][p // block_size] * block_size + p % block_size for p in positions]

    for r, (ctx, _) in enumerate(cases):  # earlier steps filled the context
        old = torch.tensor(slots(r, range(ctx)), dtype=torch.long)
        write_kv_cache(keys[r][:ctx], values[r][:ctx], k_cache, v_cache, old)
    slot_mapping = torch.tensor(
        [s for r, (c, n) in enumerate(cases) for s in slots(r, range(c, c + n))], dtype=torch.long
    )
    new_k = torch.cat([keys[r][c:] for r, (c, _) in enumerate(cases)])
    new_v = torch.cat([values[r][c:] for r, (c, _) in enumerate(cases)])
    write_kv_cache(new_k, new_v, k_cache, v_cache, slot_mapping)
    q = torch.randn(len(slot_mapping), num_heads, HEAD_DIM, generator=gen)
    metadata = build_attention_metadata(
        torch.tensor([n for _, n in cases]),
        torch.tensor([c + n for c, n in cases]),
        block_tables,
        slot_mapping,
        block_size,
        torch.device("cpu"),
    )
    scale = HEAD_DIM**-0.5
    out = paged_attention(q, k_cache, v_cache, metadata, scale)
    start = 0
    for r, (ctx, new) in enumerate(cases):
        expected = dense_causal_attention(q[start : start + new], keys[r], values[r], ctx, scale)
        torch.testing.assert_close(out[start : start + new].double(), expected, atol=2e-5, rtol=0)
        start += new


MIXED = [(0, 7), (40, 1), (0, 1), (33, 20), (5, 1), (17, 16), (0, 45), (100, 1)]


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_mixed_prefill_chunks_and_decodes(
    block_size: int, num_heads: int, num_kv_heads: int
) -> None:
    run_case(MIXED, block_size, num_heads, num_kv_heads, seed=block_size + num_heads)


@pytest.mark.parametrize("block_size", [1, 16])
def test_pure_decode_batch(block_size: int) -> None:
    run_case([(c, 1) for c in (0, 3, 15, 16, 17, 64, 200)], block_size, 8, 2, seed=1)


@pytest.mark.parametrize(
    "cases",
    [
        [(0, 31), (0, 1), (0, 64), (0, 2)],
        [(0, 31), (0, 20)],  # one padded bucket, no decode group
        [(0, 40)],  # a lone prompt: is_causal, no mask
        [(24, 40)],  # a lone later chunk
    ],
)
def test_pure_prefill_batch(cases: list[tuple[int, int]]) -> None:
    run_case(cases, 16, 4, 2, seed=2)


def test_prefill_buckets_bound_padding() -> None:
    """One long prompt and many short ones are not padded to one [B, 300, 300] block."""
    cases = [(0, 300)] + [(0, 5)] * 6 + [(50, 7), (2, 1)]
    run_case(cases, 16, 4, 2, seed=3)
    query_lens, seq_lens = (
        torch.tensor([n for _, n in cases]),
        torch.tensor([c + n for c, n in cases]),
    )
    metadata = build_attention_metadata(
        query_lens,
        seq_lens,
        torch.zeros(len(cases), 19, dtype=torch.int32),
        torch.zeros(int(query_lens.sum()), dtype=torch.long),
        16,
        torch.device("cpu"),
    )
    groups = metadata.torch_groups()
    assert [tuple(g.query_index.shape) for g in groups] == [(1, 1), (1, 300), (1, 7), (6, 5)]
    assert groups[1].causal_len == 300 and groups[2].causal_len is None


def test_metadata_fields() -> None:
    metadata = build_attention_metadata(
        torch.tensor([3, 1]),
        torch.tensor([3, 10]),
        torch.tensor([[4, 0], [2, 7]], dtype=torch.int32),
        torch.tensor([16 * 4, 16 * 4 + 1, 16 * 4 + 2, 16 * 7 + 9]),
        16,
        torch.device("cpu"),
    )
    assert metadata.query_start_loc.tolist() == [0, 3, 4]
    assert (metadata.max_query_len, metadata.max_seq_len, metadata.num_tokens) == (3, 10, 4)
    decode, prefill = metadata.torch_groups()
    assert decode.query_index.tolist() == [[3]] and decode.block_ids.tolist() == [2]
    assert prefill.query_index.tolist() == [[0, 1, 2]]
    assert prefill.key_mask[0, :, :3].tolist() == [
        [True, False, False],
        [True, True, False],
        [True, True, True],
    ]
