"""The torch paged-attention reference and the CPU backend (head-major cache: C++ decode
kernel and pure-torch paths) against a naive dense causal attention; the C++ per-token kernels
against the torch references of kernels.ops."""

from __future__ import annotations

import functools

import pytest
import torch

from pagedserve.kernels import cpu_attention, ops
from pagedserve.kernels.attention_metadata import build_attention_metadata, cdiv
from pagedserve.kernels.attention_ref import paged_attention, torch_groups, write_kv_cache
from pagedserve.kernels.cpu_attention import (
    cpu_decode_kernel_applies,
    paged_attention_head_major,
    write_kv_cache_head_major,
)
from pagedserve.kernels.cpu_kernels import load_cpu_kernels

# reference: token-major cache, paged_attention. head_major_torch / head_major_kernel: the CPU
# backend's head-major cache with its pure-torch decode path or its C++ decode kernel.
BACKENDS = ["reference", "head_major_torch", "head_major_kernel"]


@pytest.fixture(scope="module")
def cpu_kernels() -> bool:
    """Builds the C++ CPU kernels (first use on a machine: ~30 s) or finds them unavailable."""
    return load_cpu_kernels()


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
    cases: list[tuple[int, int]],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    seed: int,
    backend: str = "reference",
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

    use_kernel = backend == "head_major_kernel"
    if use_kernel and not load_cpu_kernels():
        pytest.skip("the C++ CPU kernels are not available here")
    write = write_kv_cache
    if backend != "reference":  # the same random contents, head-major
        k_cache, v_cache = (c.permute(2, 0, 1, 3).contiguous() for c in (k_cache, v_cache))
        write = functools.partial(write_kv_cache_head_major, use_kernel=use_kernel)
    for r, (ctx, _) in enumerate(cases):  # earlier steps filled the context
        old = torch.tensor(slots(r, range(ctx)), dtype=torch.long)
        write(keys[r][:ctx], values[r][:ctx], k_cache, v_cache, old)
    slot_mapping = torch.tensor(
        [s for r, (c, n) in enumerate(cases) for s in slots(r, range(c, c + n))], dtype=torch.long
    )
    new_k = torch.cat([keys[r][c:] for r, (c, _) in enumerate(cases)])
    new_v = torch.cat([values[r][c:] for r, (c, _) in enumerate(cases)])
    write(new_k, new_v, k_cache, v_cache, slot_mapping)
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
    if backend == "reference":
        out = paged_attention(q, k_cache, v_cache, metadata, scale)
    else:
        if use_kernel and not cpu_decode_kernel_applies(q, num_kv_heads):
            pytest.skip("the C++ decode kernel does not take this shape")
        out = paged_attention_head_major(
            q, k_cache, v_cache, metadata, scale, use_kernel=use_kernel
        )
    start = 0
    for r, (ctx, new) in enumerate(cases):
        expected = dense_causal_attention(q[start : start + new], keys[r], values[r], ctx, scale)
        torch.testing.assert_close(out[start : start + new].double(), expected, atol=2e-5, rtol=0)
        start += new


MIXED = [(0, 7), (40, 1), (0, 1), (33, 20), (5, 1), (17, 16), (0, 45), (100, 1)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_mixed_prefill_chunks_and_decodes(
    block_size: int, num_heads: int, num_kv_heads: int, backend: str, cpu_kernels: bool
) -> None:
    run_case(MIXED, block_size, num_heads, num_kv_heads, block_size + num_heads, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 16])
def test_pure_decode_batch(block_size: int, backend: str, cpu_kernels: bool) -> None:
    run_case([(c, 1) for c in (0, 3, 15, 16, 17, 64, 200)], block_size, 8, 2, 1, backend)


@pytest.mark.parametrize("backend", ["head_major_torch", "head_major_kernel"])
def test_decode_buckets_and_long_contexts(backend: str, cpu_kernels: bool) -> None:
    """Contexts spread wide enough for several torch-path buckets; tiles of 16 keys and tails
    in the kernel; 8 query heads per kv head."""
    cases = [(c, 1) for c in (700, 3, 250, 31, 32, 33, 499, 120, 0, 64)]
    run_case(cases, 16, 8, 1, seed=5, backend=backend)
    assert cpu_attention._split_decodes([40, 40, 30, 5, 5, 4], 20) == [0, 2, 3, 6]


@pytest.mark.parametrize(
    "cases",
    [
        [(0, 31), (0, 1), (0, 64), (0, 2)],
        [(0, 31), (0, 20)],  # one padded bucket, no decode group
        [(0, 40)],  # a lone prompt: is_causal, no mask
        [(24, 40)],  # a lone later chunk
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_pure_prefill_batch(cases: list[tuple[int, int]], backend: str, cpu_kernels: bool) -> None:
    run_case(cases, 16, 4, 2, seed=2, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_padded_group_as_large_as_the_step(backend: str, cpu_kernels: bool) -> None:
    """Prefill chunks of 7 and 5 tokens padded to [2, 7] = 14 rows in a step of 14 tokens (two
    decodes): the group still scatters its 12 real rows."""
    run_case([(0, 7), (9, 1), (3, 5), (12, 1)], 4, 4, 2, seed=4, backend=backend)


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
    groups = torch_groups(metadata)
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
    decode, prefill = torch_groups(metadata)
    assert decode.query_index.tolist() == [[3]] and decode.block_ids.tolist() == [2]
    assert prefill.query_index.tolist() == [[0, 1, 2]]
    assert prefill.key_mask[0, :, :3].tolist() == [
        [True, False, False],
        [True, True, False],
        [True, True, True],
    ]


# ------------------------------------------------------------------ the C++ per-token kernels


@pytest.fixture
def kernels(cpu_kernels: bool) -> None:
    if not cpu_kernels:
        pytest.skip("the C++ CPU kernels are not available here")


def test_cpu_rms_norms(kernels: None) -> None:
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(37, 200, generator=gen), torch.randn(37, 200, generator=gen)
    weight = torch.randn(200, generator=gen)
    out = torch.empty_like(x)
    torch.ops.pagedserve_cpu.rms_norm(out, x, weight, 1e-5)
    torch.testing.assert_close(out, ops.rms_norm(x, weight, 1e-5), atol=1e-6, rtol=1e-5)
    expected, expected_residual = ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    torch.ops.pagedserve_cpu.fused_add_rms_norm(x, residual, weight, 1e-5)  # in place
    assert torch.equal(residual, expected_residual)
    torch.testing.assert_close(x, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 32, 40])
def test_cpu_rotary_in_place(kernels: None, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    cos_cache = torch.randn(64, head_dim // 2, generator=gen)
    sin_cache = torch.randn(64, head_dim // 2, generator=gen)
    positions = torch.randint(0, 64, (9,), generator=gen)
    qkv = torch.randn(9, 7, head_dim, generator=gen)
    qk = qkv[:, :5]  # a strided view, as in the model
    expected = ops.apply_rotary(qk, cos_cache[positions], sin_cache[positions])
    untouched = qkv[:, 5:].clone()
    torch.ops.pagedserve_cpu.rotary_inplace(qk, positions, cos_cache, sin_cache)
    assert torch.equal(qk, expected)  # the same products and sums: bit-identical
    assert torch.equal(qkv[:, 5:], untouched)


def test_cpu_silu_and_mul(kernels: None) -> None:
    x = torch.randn(13, 2 * 150, generator=torch.Generator().manual_seed(1)) * 8
    out = torch.empty(13, 150)
    torch.ops.pagedserve_cpu.silu_and_mul(out, x)
    torch.testing.assert_close(out, ops.silu_and_mul(x), atol=1e-5, rtol=1e-5)


def test_cpu_silu_and_mul_at_extreme_gates(kernels: None) -> None:
    """exp(-g) past float range (g far below -88) gives silu(g) -> -0, not garbage."""
    gates = torch.tensor([-1e30, -1e4, -100.0, -89.0, -88.7, -87.5, -20.0, 0.0, 100.0, 1e30])
    x = torch.cat([gates.repeat(2), torch.full((20,), 3.0)]).view(1, 40)
    out = torch.empty(1, 20)
    torch.ops.pagedserve_cpu.silu_and_mul(out, x)
    torch.testing.assert_close(out, ops.silu_and_mul(x), atol=1e-5, rtol=1e-5)


def test_cpu_write_kv_head_major(kernels: None) -> None:
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = torch.zeros(2, 5, 4, 32), torch.zeros(2, 5, 4, 32)
    kv = torch.randn(6, 4, 32, generator=gen)  # [T, 2 * kv_heads, D]: k and v side by side
    k, v = kv[:, :2], kv[:, 2:]
    slots = torch.tensor([3, 0, 19, 7, 8, 12])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k.view(2, -1, 32)[:, slots] = k.transpose(0, 1)
    expected_v.view(2, -1, 32)[:, slots] = v.transpose(0, 1)
    torch.ops.pagedserve_cpu.write_kv_head_major(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
