"""The mixture-of-experts Triton kernels (pagedserve.kernels.triton_moe) against the reference
(kernels.moe_ref), on the CPU through Triton's interpreter (TRITON_INTERPRET=1; see
test_triton_kernels.py for how the interpreter is chosen and the fresh-process fallback).

Tolerances: fp32 within 1e-5 (exact products, outputs O(1)); bf16 against the reference run in
fp32 on the same bf16 inputs, within 2% of the output's scale (the activation between the
GEMMs is rounded to bf16, as the kernels' operands must be). Quantized experts (fp8, int4)
against the reference on their dequantized weights, the same way.
"""

from __future__ import annotations

import pytest

from tests.interpreter import (
    fresh_process_test,
    interpret_triton,
    interpreted,
    skip_unless_interpreted,
)

IN_PROCESS = interpret_triton()

import torch  # noqa: E402

from pagedserve.kernels import moe_ref, quant_ref  # noqa: E402
from pagedserve.kernels.attention_backends import torch_ref_backend  # noqa: E402
from pagedserve.models.gpt_oss import GptOssMoE  # noqa: E402
from pagedserve.models.layer_config import LayerConfig  # noqa: E402
from pagedserve.models.model_config import ModelConfig  # noqa: E402
from pagedserve.models.moe import SparseMoeBlock  # noqa: E402
from pagedserve.models.quantization.config import IntScheme, QuantizationConfig  # noqa: E402

tm = interpreted("pagedserve.kernels.triton_moe", "_expert_gemm_kernel", IN_PROCESS)
_kernels_in_this_process = skip_unless_interpreted(IN_PROCESS)
test_kernels_in_a_fresh_interpreter_process = fresh_process_test(__file__, IN_PROCESS)


def routing(t: int, experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k distinct experts, drawn from the first experts - 1 (the last one never
    gets a token), and their float32 weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts - 1, generator=gen)[:k] for _ in range(t)])
    return torch.rand(t, k, generator=gen), ids


@pytest.mark.parametrize(("t", "k", "block_m"), [(1, 2, 16), (7, 3, 16), (50, 2, 64), (700, 2, 16)])
def test_align_by_expert_groups_every_pair_once(t: int, k: int, block_m: int) -> None:
    assert tm is not None
    experts = 6
    _, ids = routing(t, experts, k, seed=t)
    blocks = tm.align_by_expert(ids, experts, block_m)
    used = int(blocks.num_blocks[0])
    assert used <= blocks.max_blocks
    pairs = blocks.pairs.view(-1, block_m)
    flat = ids.reshape(-1)
    seen: list[int] = []
    for b in range(used):
        real = [p for p in pairs[b].tolist() if p < t * k]
        assert real, f"block {b} is all padding"
        assert {int(flat[p]) for p in real} == {int(blocks.block_experts[b])}
        assert pairs[b].tolist() == real + [t * k] * (block_m - len(real))
        seen += real
    assert sorted(seen) == list(range(t * k))
    assert (pairs[used:] == t * k).all()  # the grid's spare blocks hold nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "k"), [(1, 2), (5, 3), (60, 2), (100, 2)])
def test_fused_experts_match_the_reference(dtype: torch.dtype, t: int, k: int) -> None:
    """Tiles of 16, 16, 32 and 64 rows (the pairs an expert gets on average); hidden 72 and
    intermediate 40: neither a multiple of the tiles' K or N."""
    assert tm is not None
    gen = torch.Generator().manual_seed(t * 10 + k)
    experts, hidden, inter = 5, 72, 40
    x = torch.randn(t, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.2).to(dtype)
    weights, ids = routing(t, experts, k, seed=t)
    expected_block_m = {1: 16, 5: 16, 60: 32, 100: 64}[t]
    assert tm._tiles(t * k, experts).block_m == expected_block_m
    got = tm.fused_experts(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == (t, hidden)
    want = moe_ref.fused_experts(x.float(), w13.float(), w2.float(), weights, ids)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        scale = float(want.abs().max())
        assert float((got.float() - want).abs().max()) < 0.02 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "k"), [(3, 2), (60, 4)])
def test_gpt_oss_experts_match_the_reference(dtype: torch.dtype, t: int, k: int) -> None:
    """GPT-OSS's experts: biases on both GEMMs and the clamped activation, with dots large
    enough that the clamp at 1.5 cuts gates and ups."""
    assert tm is not None
    gen = torch.Generator().manual_seed(t + k)
    experts, hidden, inter = 6, 48, 40
    x = torch.randn(t, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.4).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.2).to(dtype)
    b13 = torch.randn(experts, 2 * inter, generator=gen).to(dtype)
    b2 = torch.randn(experts, hidden, generator=gen).to(dtype)
    weights, ids = routing(t, experts, k, seed=t)
    clamped = moe_ref.ClampedSwiGLU(alpha=1.702, limit=1.5)
    got = tm.fused_experts(x, w13, w2, weights, ids, biases=(b13, b2), clamped=clamped)
    floats = (x.float(), w13.float(), w2.float(), weights, ids)
    want = moe_ref.fused_experts(*floats, biases=(b13.float(), b2.float()), clamped=clamped)
    plain = moe_ref.fused_experts(*floats)
    assert float((want - plain).abs().max()) > 0.5  # the biases and the clamp matter here
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert float((got.float() - want).abs().max()) < 0.02 * float(want.abs().max())


def random_mxfp4_experts(experts: int, n: int, k: int, seed: int) -> moe_ref.Mxfp4Experts:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (experts, n, k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(122, 128, (experts, n, k // 32), generator=gen, dtype=torch.uint8)
    return moe_ref.Mxfp4Experts(codes, scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "k"), [(2, 2), (40, 3)])
def test_mxfp4_experts_match_their_dequantized_weights(dtype: torch.dtype, t: int, k: int) -> None:
    """MXFP4 experts (GPT-OSS's, with its biases and clamp) decoded tile by tile in the GEMMs
    equal the reference on the weights they encode (exact in bf16): K of 96 and 64, so a tile
    of K spans several scales."""
    assert tm is not None
    gen = torch.Generator().manual_seed(t)
    experts, hidden, inter = 5, 64, 96
    w13 = random_mxfp4_experts(experts, 2 * inter, hidden, seed=1)
    w2 = random_mxfp4_experts(experts, hidden, inter, seed=2)
    x = torch.randn(t, hidden, generator=gen).to(dtype)
    b13 = torch.randn(experts, 2 * inter, generator=gen).to(dtype)
    b2 = torch.randn(experts, hidden, generator=gen).to(dtype)
    weights, ids = routing(t, experts, k, seed=t)
    clamped = moe_ref.ClampedSwiGLU(alpha=1.702, limit=7.0)
    extra = {"clamped": clamped}
    got = tm.fused_experts(x, w13, w2, weights, ids, biases=(b13, b2), **extra)
    dense = [quant_ref.dequantize_mxfp4(w.codes, w.scales, torch.float32) for w in (w13, w2)]
    floats = (b13.float(), b2.float())
    want = moe_ref.fused_experts(x.float(), *dense, weights, ids, biases=floats, **extra)
    # the reference takes MXFP4 experts as the weights they encode
    as_mxfp4 = moe_ref.fused_experts(x.float(), w13, w2, weights, ids, biases=floats, **extra)
    assert torch.equal(as_mxfp4, want)
    if dtype == torch.float32:  # the kernel sums k in another order: float32 rounding apart
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    else:
        assert float((got.float() - want).abs().max()) < 0.02 * float(want.abs().max())


@pytest.mark.parametrize("experts", [2, 40])  # tiles of 64 and of 16 pairs
def test_mxfp4_expert_gemm_decodes_every_code_and_scale_exactly(experts: int) -> None:
    """Through the expert GEMM with x = I (each pair one column k, weight 1): out[k, n] =
    W[e, n, k] equals the reference's value bit for bit, for all 16 codes and scales 2^-127
    to 2^125 (s = 0 .. 252: 6 x 2^126 would be past float32's range)."""
    assert tm is not None
    n, k = 48, 256
    gen = torch.Generator().manual_seed(experts)
    codes = torch.randint(0, 256, (experts, n, k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 253, (experts, n, k // 32), generator=gen, dtype=torch.uint8)
    scales[0, :6, 0] = torch.tensor([0, 1, 2, 127, 251, 252], dtype=torch.uint8)
    w = moe_ref.Mxfp4Experts(codes, scales)
    dense = quant_ref.dequantize_mxfp4(codes, scales, torch.float32)
    for expert in (0, experts - 1):
        tiles = tm._tiles(k, experts)
        blocks = tm.align_by_expert(torch.full((k, 1), expert, dtype=torch.int32), experts,
                                    tiles.block_m)  # fmt: skip
        out = torch.empty(k, n)
        tm._expert_gemm(torch.eye(k), tm._operands(w, None), out, blocks, torch.ones(k), 1, tiles)
        assert torch.equal(out, dense[expert].T)


def test_mxfp4_decoding_is_transformers() -> None:
    """quant_ref.dequantize_mxfp4 is transformers' convert_moe_packed_tensors (which returns
    the weight transposed, [..., K, N])."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    w = random_mxfp4_experts(3, 10, 128, seed=3)
    blocks = w.codes.unflatten(-1, (-1, 16))
    want = mxfp4.convert_moe_packed_tensors(blocks, w.scales, dtype=torch.float32)
    assert torch.equal(quant_ref.dequantize_mxfp4(w.codes, w.scales, torch.float32),
                       want.transpose(1, 2))  # fmt: skip


def test_clamped_activation_follows_transformers() -> None:
    """moe_ref.ClampedSwiGLU is transformers' GptOssExperts._apply_gate on de-interleaved
    gate and up."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    config = gpt_oss.GptOssConfig(num_local_experts=2, hidden_size=8, intermediate_size=16)
    experts = gpt_oss.GptOssExperts(config)
    gate_up = torch.randn(5, 32) * 6  # interleaved, as transformers holds them
    want = experts._apply_gate(gate_up)
    clamped = moe_ref.ClampedSwiGLU(alpha=config.swiglu_alpha, limit=config.swiglu_limit)
    got = moe_ref.gated_activation(torch.cat([gate_up[:, ::2], gate_up[:, 1::2]], -1), clamped)
    torch.testing.assert_close(got, want)


def test_fused_experts_reject_bad_arguments() -> None:
    assert tm is not None
    x = torch.randn(3, 8)
    w13, w2 = torch.randn(4, 12, 8), torch.randn(4, 8, 6)
    weights, ids = routing(3, 4, 2, seed=0)
    with pytest.raises(ValueError, match="do not fit"):
        tm.fused_experts(x, w13, torch.randn(4, 8, 5), weights, ids)
    with pytest.raises(ValueError, match="topk ids"):
        tm.fused_experts(x, w13, w2, weights[:, :1], ids)
    with pytest.raises(ValueError, match="float32"):
        tm.fused_experts(x, w13, w2, weights.double(), ids)
    with pytest.raises(ValueError, match="contiguous"):
        tm.fused_experts(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, weights, ids)
    with pytest.raises(ValueError, match="expert bias"):
        tm.fused_experts(x, w13, w2, weights, ids, biases=(torch.zeros(4, 6), None))
    empty = tm.fused_experts(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 8)


def test_the_block_takes_the_kernels_on_the_triton_path() -> None:
    """A SparseMoeBlock with fused_ops "triton" (the CUDA configuration: the fused router and
    the expert kernels) gives the torch path's output."""
    gen = torch.Generator().manual_seed(1)
    blocks = {}
    for fused_ops in ("triton", "torch"):
        config = LayerConfig(
            torch.device("cpu"), torch.float32, torch_ref_backend(), fused_ops=fused_ops
        )
        blocks[fused_ops] = SparseMoeBlock(24, (6, 2, 20), renormalize=True, config=config)
    weights = {
        "gate.weight": torch.randn(6, 24, generator=gen),
        "experts.w13": torch.randn(6, 40, 24, generator=gen),
        "experts.w2": torch.randn(6, 24, 20, generator=gen),
    }
    for block in blocks.values():
        for name, param in block.named_parameters():
            param.data.copy_(weights[name])
    x = torch.randn(7, 24, generator=gen)
    torch.testing.assert_close(blocks["triton"](x), blocks["torch"](x), rtol=1e-5, atol=1e-5)


def test_the_gpt_oss_block_takes_the_kernels_on_the_triton_path() -> None:
    """GPT-OSS's block (the router's bias, the experts' biases and clamp) with fused_ops
    "triton" gives the torch path's output."""
    gen = torch.Generator().manual_seed(2)
    sizes = {"hidden_size": 24, "intermediate_size": 20, "num_local_experts": 6}
    hf = ModelConfig(
        {"model_type": "gpt_oss", "num_experts_per_tok": 2, "swiglu_limit": 1.0, **sizes}
    )
    blocks = {}
    for fused_ops in ("triton", "torch"):
        config = LayerConfig(
            torch.device("cpu"), torch.float32, torch_ref_backend(), fused_ops=fused_ops
        )
        blocks[fused_ops] = GptOssMoE(hf, config)
    weights = {name: torch.randn(param.shape, generator=gen)
               for name, param in blocks["torch"].named_parameters()}  # fmt: skip
    for block in blocks.values():
        for name, param in block.named_parameters():
            param.data.copy_(weights[name])
    x = torch.randn(7, 24, generator=gen)
    torch.testing.assert_close(blocks["triton"](x), blocks["torch"](x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (60, 4), (128, 8), (5, 5)])
def test_route_matches_softmax_and_top_k(experts: int, top_k: int, renormalize: bool) -> None:
    """The fused router kernel against torch's softmax, topk and renormalisation (bf16 logits,
    as a bf16 model's router gives them, with ties): the same weights, largest first, of
    experts at least as likely as every one left out (among equal ones the lower expert
    first; torch's choice among ties is its own)."""
    assert tm is not None
    gen = torch.Generator().manual_seed(experts + top_k)
    logits = (torch.randn(9, experts, generator=gen) * 3).to(torch.bfloat16)
    weights, ids = tm.route(logits, top_k, renormalize)
    probs = torch.softmax(logits.float(), dim=-1)
    want_weights, want_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        want_weights = want_weights / want_weights.sum(dim=-1, keepdim=True)
    assert ids.dtype == torch.int32
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-6)  # sorted values
    for row in range(logits.shape[0]):
        chosen = ids[row].long()
        assert len(set(chosen.tolist())) == top_k
        others = torch.ones(experts, dtype=torch.bool)
        others[chosen] = False
        if others.any():  # every chosen expert is at least as likely as every other
            assert probs[row, chosen].min() >= probs[row, others].max()
        order = list(zip((-probs[row, chosen]).tolist(), chosen.tolist()))
        assert order == sorted(order)  # largest first, ties by the lower expert
    with pytest.raises(ValueError, match="1 <= k <= E"):
        tm.route(logits, experts + 1, renormalize)


@pytest.mark.parametrize(("t", "k"), [(1, 2), (60, 2)])
def test_fp8_experts_match_their_dequantized_weights(t: int, k: int) -> None:
    """W8A16: fp8 weights with a scale per output channel, bf16 activations, against the
    reference on the dequantized weights in fp32 (within 2% of the output's scale); a mutated
    scale of one expert's up rows changes the tokens routed to it."""
    assert tm is not None
    gen = torch.Generator().manual_seed(t)
    experts, hidden, inter = 5, 72, 40
    x = torch.randn(t, hidden, generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 50).to(torch.float8_e4m3fn)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 50).to(torch.float8_e4m3fn)
    scales = (torch.rand(experts, 2 * inter, generator=gen) * 0.01 + 0.001,
              torch.rand(experts, hidden, generator=gen) * 0.01 + 0.001)  # fmt: skip
    weights, ids = routing(t, experts, k, seed=t)
    got = tm.fused_experts(x, w13, w2, weights, ids, scales=scales)
    dequantized = (w13.float() * scales[0][..., None], w2.float() * scales[1][..., None])
    want = moe_ref.fused_experts(x.float(), *dequantized, weights, ids)
    scale = float(want.abs().max())
    assert float((got.float() - want).abs().max()) < 0.02 * scale
    up_of_expert = scales[0].clone()
    expert = int(ids[0, 0])
    up_of_expert[expert, inter:] *= 2
    changed = tm.fused_experts(x, w13, w2, weights, ids, scales=(up_of_expert, scales[1]))
    assert not torch.equal(changed[0], got[0])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        tm.fused_experts(x, w13.to(torch.bfloat16), w2, weights, ids, scales=scales)


def int4_experts(
    experts: int, n: int, k: int, group: int, symmetric: bool, gen: torch.Generator,
    dtype: torch.dtype,
) -> moe_ref.Int4Experts:  # fmt: skip
    """Random weights [experts, n, k] quantized to int4 in groups of `group` inputs (k: one
    group a row), scales and zeros in dtype."""
    weights = [
        quant_ref.quantize_int_weight(torch.randn(n, k, generator=gen) * 0.2, 4, group, symmetric)
        for _ in range(experts)
    ]
    return moe_ref.Int4Experts(
        torch.stack([w.qweight for w in weights]),
        torch.stack([w.scales for w in weights]).to(dtype),
        torch.stack([w.zeros for w in weights]).to(dtype),
        group,
    )


def groups_of(group: int | None, k: int) -> int:
    """`group` where it divides k, else one group of k."""
    return group if group and k % group == 0 else k


def in_float32(w: moe_ref.Int4Experts) -> moe_ref.Int4Experts:
    return moe_ref.Int4Experts(w.qweight, w.scales.float(), w.zeros.float(), w.group_size)


@pytest.mark.parametrize(
    ("dtype", "t", "group", "symmetric"),
    [
        (torch.float32, 1, 32, True),
        (torch.float32, 60, 64, False),
        (torch.float32, 7, 48, True),  # K tiles of 16 (the largest power of two dividing 48)
        (torch.bfloat16, 5, 32, False),
        (torch.bfloat16, 100, None, True),  # one group a row
    ],
)  # fmt: skip
def test_int4_experts_match_their_dequantized_weights(
    dtype: torch.dtype, t: int, group: int | None, symmetric: bool
) -> None:
    """W4A16: int4 codes dequantized in the GEMMs' K loop, (q - z) * s by groups, against the
    reference on the same weights (hidden 192, intermediate 96: groups that do not divide them
    fall back to one a row)."""
    assert tm is not None
    gen = torch.Generator().manual_seed(t)
    experts, hidden, inter, k = 5, 192, 96, 2
    w13 = int4_experts(experts, 2 * inter, hidden, groups_of(group, hidden), symmetric, gen, dtype)
    w2 = int4_experts(experts, hidden, inter, groups_of(group, inter), symmetric, gen, dtype)
    x = torch.randn(t, hidden, generator=gen).to(dtype)
    weights, ids = routing(t, experts, k, seed=t)
    got = tm.fused_experts(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == (t, hidden)
    want = moe_ref.fused_experts(x.float(), in_float32(w13), in_float32(w2), weights, ids)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # 3%: the interpreter truncates each dequantized weight to bf16 (a GPU rounds it)
        assert float((got.float() - want).abs().max()) < 0.03 * float(want.abs().max())


def test_int4_experts_reject_bad_arguments() -> None:
    assert tm is not None
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 48)
    weights, ids = routing(3, 4, 2, seed=0)
    w13 = int4_experts(4, 64, 48, 16, True, gen, torch.float32)
    w2 = int4_experts(4, 48, 32, 16, True, gen, torch.float32)
    tm.fused_experts(x, w13, w2, weights, ids)
    with pytest.raises(ValueError, match="both Int4Experts"):
        tm.fused_experts(x, w13, torch.randn(4, 48, 32), weights, ids)
    odd_groups = int4_experts(4, 64, 48, 24, True, gen, torch.float32)
    with pytest.raises(ValueError, match="a multiple of 16"):
        tm.fused_experts(x, odd_groups, w2, weights, ids)
    column_major = w2.scales.transpose(1, 2).contiguous().transpose(1, 2)
    strided = moe_ref.Int4Experts(w2.qweight, column_major, w2.zeros, w2.group_size)
    with pytest.raises(ValueError, match="contiguous"):
        tm.fused_experts(x, w13, strided, weights, ids)


def test_int4_block_takes_the_kernels_on_the_triton_path() -> None:
    """A SparseMoeBlock with int4 experts (float weights quantized at load, groups of 32) on
    the Triton path gives the torch path's output."""
    gen = torch.Generator().manual_seed(2)
    quantization = QuantizationConfig("gptq", IntScheme(4, 32, symmetric=False, source="float"))
    weights = {
        "gate.weight": torch.randn(6, 64, generator=gen),
        "experts.w13": torch.randn(6, 64, 64, generator=gen) * 0.2,
        "experts.w2": torch.randn(6, 64, 32, generator=gen) * 0.2,
    }
    blocks = {}
    for fused_ops in ("triton", "torch"):
        config = LayerConfig(
            torch.device("cpu"), torch.float32, torch_ref_backend(), fused_ops=fused_ops,
            quantization=quantization,
        )  # fmt: skip
        block = SparseMoeBlock(64, (6, 2, 32), renormalize=True, config=config)
        for name, param in block.named_parameters():
            param.data.copy_(weights[name])
        block.experts.process_weights_after_loading()
        assert block.experts.w13.dtype == torch.int32
        blocks[fused_ops] = block
    x = torch.randn(7, 64, generator=gen)
    torch.testing.assert_close(blocks["triton"](x), blocks["torch"](x), rtol=1e-5, atol=1e-5)
