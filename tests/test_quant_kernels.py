"""The quantized matmuls and quantizers (kernels.quant_ref, and the Triton kernels of
kernels.triton_quant / triton_attention under Triton's CPU interpreter; see
test_triton_kernels.py for how the interpreter is chosen) against dequantized float references.

Every matmul is checked against x @ W_deq^T computed in float64 from the very quantized values
the kernel reads (the codes, scales and zeros, or the fp8 values and scales): what is checked
is the kernel's arithmetic, not the quantization error. The quantizers are checked against
their definitions (round to nearest, saturation); the Triton ones give torch's fp8 values.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import replace
from types import ModuleType

import pytest

_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton.language.standard as _tl_standard
    from triton.runtime.interpreter import InterpretedFunction
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"triton is not importable ({exc}): no kernel tests", allow_module_level=True)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pagedserve.kernels import quant_ref  # noqa: E402
from pagedserve.kernels.attention_metadata import build_attention_metadata  # noqa: E402
from pagedserve.kernels.attention_ref import paged_attention as reference_attention  # noqa: E402
from pagedserve.kernels.attention_ref import write_kv_cache as reference_write  # noqa: E402
from pagedserve.kernels.quant_ref import FP8_DTYPE, IntWeight  # noqa: E402
from tests.interpreter import assert_passes_in_fresh_interpreter  # noqa: E402

IN_PROCESS = isinstance(_tl_standard.sum, InterpretedFunction)
if not IN_PROCESS:
    if _PREVIOUS_INTERPRET is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _PREVIOUS_INTERPRET


def _interpreted(name: str, kernel: str) -> ModuleType | None:
    if not IN_PROCESS:
        return None
    module = importlib.import_module(name)
    assert isinstance(getattr(module, kernel), InterpretedFunction)
    return module


tq = _interpreted("pagedserve.kernels.triton_quant", "_quant_gemv_kernel")
ta = _interpreted("pagedserve.kernels.triton_attention", "_prefill_kernel")
FRESH_PROCESS_TEST = "test_kernels_in_a_fresh_interpreter_process"


@pytest.fixture(autouse=True)
def _kernels_in_this_process(request: pytest.FixtureRequest) -> None:
    triton_test = "triton" in request.node.originalname
    if triton_test and not IN_PROCESS and request.node.originalname != FRESH_PROCESS_TEST:
        pytest.skip("triton was imported in compiled mode: see " + FRESH_PROCESS_TEST)


def test_kernels_in_a_fresh_interpreter_process() -> None:
    if IN_PROCESS:
        pytest.skip("the kernels run in this process")
    assert_passes_in_fresh_interpreter(__file__)


def fp8_step(values: torch.Tensor) -> torch.Tensor:
    """One fp8 (E4M3) step at each value: 2^(exponent - 3), subnormals 2^-9."""
    exponent = torch.floor(torch.log2(values.abs().clamp(min=2**-6)))
    return 2.0 ** (exponent - 3)


def random_int_weight(
    n: int, k: int, bits: int, group: int, symmetric: bool, seed: int, act_order: bool = False
) -> IntWeight:
    gen = torch.Generator().manual_seed(seed)
    weight = quant_ref.quantize_int_weight(
        torch.randn(n, k, generator=gen) * 0.05, bits, group, symmetric
    )
    if act_order:
        weight.perm = torch.randperm(k, generator=gen)
    return weight


def int_reference(x: torch.Tensor, weight: IntWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x[..., perm] @ W^T + b in float64 from the codes, scales and zeros."""
    codes = quant_ref.unpack_codes(weight).double()
    groups = torch.arange(codes.shape[1]) // weight.group_size
    w = (codes - weight.zeros.double()[:, groups]) * weight.scales.double()[:, groups]
    if weight.perm is not None:
        x = x.index_select(-1, weight.perm)
    return F.linear(x.double(), w, None if bias is None else bias.double())


# --------------------------------------------------------------------------- references


def test_int4_packing_round_trips() -> None:
    codes = torch.randint(0, 16, (5, 64), generator=torch.Generator().manual_seed(0))
    packed = quant_ref.pack_int4(codes)
    assert packed.shape == (5, 8) and packed.dtype == torch.int32
    assert torch.equal(quant_ref.unpack_int4(packed), codes)
    assert int(quant_ref.pack_int4(torch.arange(8).view(1, 8))[0, 0]) == 0x76543210


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int_quantization_rounds_to_the_nearest_code(bits: int, symmetric: bool) -> None:
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(bits)) * 0.1
    weight = quant_ref.quantize_int_weight(w, bits, 64, symmetric)
    codes = quant_ref.unpack_codes(weight)
    assert int(codes.min()) >= 0 and int(codes.max()) <= 2**bits - 1
    deq = quant_ref.dequantize_int_weight(weight, torch.float32)
    step = weight.scales.repeat_interleave(64, dim=1)
    assert bool(((deq - w).abs() <= step / 2 + 1e-6).all())
    if symmetric:
        assert bool((weight.zeros == 2 ** (bits - 1)).all())


def test_fp8_row_quantization() -> None:
    x = torch.randn(6, 100, generator=torch.Generator().manual_seed(1)) * 5
    xq, scale = quant_ref.quantize_fp8_rows(x)
    assert xq.dtype == FP8_DTYPE and scale.shape == (6, 1)
    torch.testing.assert_close(scale, x.abs().amax(1, keepdim=True) / 448)
    assert bool((xq.float().abs().amax(1) == 448).all())  # each row's largest saturates
    deq = xq.float() * scale
    assert bool(((deq - x).abs() <= fp8_step(x / scale) * scale / 2 + 1e-7).all())
    assert quant_ref.to_fp8(torch.tensor([1e6, -1e6]), 1.0).float().tolist() == [448, -448]


def test_fp8_scaled_matmul_is_the_dequantized_product() -> None:
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 64, generator=gen), torch.randn(24, 64, generator=gen)
    bias = torch.randn(24, generator=gen)
    wq, w_scale = quant_ref.quantize_fp8_rows(w)
    out = quant_ref.fp8_linear(x, wq, w_scale.squeeze(1), bias)
    xq, x_scale = quant_ref.quantize_fp8_rows(x)
    expected = F.linear(
        xq.double() * x_scale.double(), wq.double() * w_scale.double(), bias.double()
    )
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    static = quant_ref.fp8_linear(x, wq, w_scale.squeeze(1), None, input_scale=0.02)
    x_static = quant_ref.to_fp8(x, 0.02).double() * 0.02
    torch.testing.assert_close(static.double(), F.linear(x_static, wq.double() * w_scale.double()),
                               atol=1e-5, rtol=1e-5)  # fmt: skip


def test_int_linear_reference() -> None:
    weight = random_int_weight(40, 256, 4, 128, False, seed=3, act_order=True)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(40, generator=torch.Generator().manual_seed(5))
    out = quant_ref.int_linear(x, weight, bias)
    torch.testing.assert_close(out.double(), int_reference(x, weight, bias), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- Triton


@pytest.mark.parametrize(
    "bits,group,symmetric,act_order",
    [(4, 128, True, False), (4, 64, False, True), (8, 128, True, False), (8, 256, False, False),
     (4, 256, False, False)],
)  # fmt: skip
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_triton_int_weight_gemv(
    bits: int, group: int, symmetric: bool, act_order: bool, rows: int
) -> None:
    assert tq is not None
    weight = random_int_weight(48, 256, bits, group, symmetric, seed=rows, act_order=act_order)
    gen = torch.Generator().manual_seed(10 + rows)
    x, bias = torch.randn(rows, 256, generator=gen), torch.randn(48, generator=gen)
    out = tq.int_weight_gemv(x, weight, bias)
    torch.testing.assert_close(out.double(), int_reference(x, weight, bias), atol=2e-5, rtol=0)


def test_triton_int_weight_gemv_bf16_and_shapes() -> None:
    """bf16 activations and scales, N not a multiple of the tile, 3-D input; more rows than the
    kernel takes are refused."""
    assert tq is not None
    weight = random_int_weight(37, 128, 4, 64, False, seed=7)
    weight.scales, weight.zeros = weight.scales.bfloat16(), weight.zeros.bfloat16()
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(8)).bfloat16()
    out = tq.int_weight_gemv(x, weight)
    assert out.shape == (2, 3, 37) and out.dtype == torch.bfloat16
    expected = int_reference(x, weight, None)
    torch.testing.assert_close(out.double(), expected, atol=0, rtol=2**-7)
    with pytest.raises(ValueError, match="at most 16"):
        tq.int_weight_gemv(torch.randn(17, 128), weight)


@pytest.mark.parametrize("bits,symmetric", [(4, False), (8, True)])
def test_triton_dequantize(bits: int, symmetric: bool) -> None:
    assert tq is not None
    weight = random_int_weight(40, 256, bits, 64, symmetric, seed=bits)
    expected = quant_ref.dequantize_int_weight(weight, torch.float32)
    assert torch.equal(tq.dequantize(weight, torch.float32), expected)
    bf16 = tq.dequantize(weight, torch.bfloat16)
    assert torch.equal(bf16, expected.bfloat16())  # one rounding, nearest even


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_triton_fp8_weight_gemv(rows: int) -> None:
    assert tq is not None
    gen = torch.Generator().manual_seed(rows)
    wq, w_scale = quant_ref.quantize_fp8_rows(torch.randn(72, 192, generator=gen))
    w_scale = w_scale.squeeze(1)
    x, bias = torch.randn(rows, 192, generator=gen), torch.randn(72, generator=gen)
    out = tq.fp8_weight_gemv(x, wq, w_scale, bias)
    expected = F.linear(x.double(), wq.double() * w_scale.double()[:, None], bias.double())
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-6)


# Launch variants (QuantGemvConfig fields) the sweep compares; each must compute the same product.
INT_VARIANTS = [
    dict(use_dot=False, block_n=8, block_k=128, num_warps=1),
    dict(use_dot=False, block_n=16, block_k=64, num_warps=2, unroll=2, split_k=3),
    dict(use_dot=False, block_n=16, block_k=64, num_warps=1, unroll=4, convert="cvt"),
    dict(use_dot=False, block_n=8, block_k=128, num_warps=1, unroll=2, unpack="reshape"),
    dict(use_dot=True, block_n=16, block_k=64, num_warps=4, split_k=2),
    dict(use_dot=True, block_n=32, block_k=128, num_warps=4, convert="cvt", unpack="reshape"),
    dict(use_dot=False, block_n=8, block_k=128, num_warps=1, unroll=2, accumulate="tile"),
    dict(
        use_dot=False,
        block_n=16,
        block_k=64,
        num_warps=2,
        split_k=3,
        accumulate="tile",
        convert="cvt",
        unpack="reshape",
    ),
    dict(use_dot=False, block_n=8, block_k=128, num_warps=1, unroll=2, unpack="planes"),
    dict(use_dot=True, block_n=16, block_k=128, num_warps=4, split_k=2, unpack="planes"),
    dict(
        use_dot=False,
        block_n=16,
        block_k=64,
        num_warps=2,
        split_k=3,
        unpack="planes",
        accumulate="tile",
    ),
    dict(use_dot=False, block_n=8, block_k=128, num_warps=1, unroll=2, convert="half"),
    dict(
        use_dot=False,
        block_n=16,
        block_k=64,
        num_warps=2,
        split_k=3,
        convert="half",
        accumulate="tile",
    ),  # fmt: skip
    dict(
        use_dot=False,
        block_n=8,
        block_k=128,
        num_warps=1,
        unroll=2,
        convert="half",
        unpack="planes",
    ),  # fmt: skip
    dict(
        use_dot=False,
        block_n=16,
        block_k=64,
        num_warps=2,
        split_k=3,
        convert="half",
        unpack="planes",
        accumulate="tile",
    ),  # fmt: skip
]
FP8_VARIANTS = [
    dict(use_dot=False, block_n=4, block_k=64, num_warps=1),
    dict(use_dot=False, block_n=8, block_k=32, num_warps=1, unroll=4, split_k=3),
    dict(use_dot=False, block_n=8, block_k=64, num_warps=2, unroll=2, convert="cvt"),
    dict(use_dot=False, block_n=4, block_k=64, num_warps=1, unroll=2, convert="cvt", fold=16),
    dict(use_dot=True, block_n=16, block_k=64, num_warps=4, split_k=2),
]


@pytest.mark.parametrize(
    "variant,rows", [(v, 1 + 2 * (i % 2)) for i, v in enumerate(INT_VARIANTS)]
)  # every variant once, at 1 row (M = 1 compiles apart) or 3
@pytest.mark.parametrize("bits", [4, 8])
def test_triton_int_weight_gemv_variants(variant: dict, bits: int, rows: int) -> None:
    """Every launch variant (fma / dot, K splits, unrolled loads, codes by bits, conversion
    or fp16 bits with the 1024 offset folded into the zero point ("half"), int4 unpacked by
    interleave or reshape or left packed (planes), chunk or tile accumulation), K = 3 groups
    (a chunk pair runs past K), N not a multiple of the tile, asymmetric codes: the float64
    dequantized product (to 3e-5; "half" to 3e-4: its offset costs ~10 of fp32's 24 bits)."""
    assert tq is not None
    config = tq.QuantGemvConfig(**variant)
    weight = random_int_weight(40, 384, bits, 128, False, seed=bits + rows)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, 384, generator=gen), torch.randn(40, generator=gen)
    out = tq.int_weight_gemv(x, weight, bias, config=config)
    atol = 3e-4 if config.convert == "half" else 3e-5
    torch.testing.assert_close(out.double(), int_reference(x, weight, bias), atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [4, 8])
def test_triton_int_weight_gemv_dot_operand_bits(dtype: torch.dtype, bits: int) -> None:
    """16-bit activations on the tensor-core loop with codes built from bits (bf16: 128 + q
    for int4; fp16: 1024 + q), and group-major scales (the strides a caller may pick)."""
    assert tq is not None
    weight = random_int_weight(32, 256, bits, 128, False, seed=bits)
    weight.scales = weight.scales.to(dtype).t().contiguous().t()
    weight.zeros = weight.zeros.to(dtype).t().contiguous().t()
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(9)).to(dtype)
    expected = int_reference(x, weight, None)
    for unpack in ("interleave", "planes"):
        config = tq.QuantGemvConfig(use_dot=True, block_n=16, block_k=128, num_warps=4,
                                    split_k=2, unpack=unpack)  # fmt: skip
        out = tq.int_weight_gemv(x, weight, config=config)
        torch.testing.assert_close(out.double(), expected, atol=2e-3, rtol=2**-7)


@pytest.mark.parametrize("variant", FP8_VARIANTS)
@pytest.mark.parametrize("rows", [1, 6])
def test_triton_fp8_weight_gemv_variants(variant: dict, rows: int) -> None:
    """Every fp8 launch variant, K = 200 (a tail chunk), subnormal and zero weights included:
    the float64 product of the fp8 values and channel scales."""
    assert tq is not None
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(24, 200, generator=gen)
    w[:, :8] = torch.tensor([0.0, -0.0, 0.002, -0.003, 0.01, -0.0137, 1.0, 448.0])  # subnormals
    wq, w_scale = quant_ref.quantize_fp8_rows(w)
    w_scale = w_scale.squeeze(1)
    x, bias = torch.randn(rows, 200, generator=gen), torch.randn(24, generator=gen)
    out = tq.fp8_weight_gemv(x, wq, w_scale, bias, config=tq.QuantGemvConfig(**variant))
    expected = F.linear(x.double(), wq.double() * w_scale.double()[:, None], bias.double())
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-6)


def test_triton_quant_gemv_plans() -> None:
    """Plans: blocks clamped to the problem, integer chunks inside one group, the automatic
    split filling the SMs, tuned entries found by (SMs, scheme, M bucket, N, K)."""
    assert tq is not None
    fma = tq.QuantGemvConfig(use_dot=False, block_n=64, block_k=256, num_warps=4, unroll=2)
    plan = tq.plan_quant_gemv("int4", 1, 4096, 4096, 128, 132, fma)
    assert plan.config.block_k == 128 and plan.tiles == 64 and plan.split_k == 8
    assert plan.k_per_split % (128 * 2) == 0 and plan.k_per_split * plan.split_k >= 4096
    assert tq.plan_quant_gemv("fp8", 1, 8, 100, 100, 132, fma).config.block_n == 8
    assert tq.m_bucket("int8", 3) == 4 and tq.m_bucket("fp8", 16) == 16
    with pytest.raises(ValueError, match="at most 16"):
        tq.m_bucket("int8", 17)
    with pytest.raises(ValueError, match="power of 2"):
        tq.check_quant_gemv_config(tq.QuantGemvConfig(False, 3, 128, 4))
    with pytest.raises(ValueError, match="fma loops only"):
        tq.check_quant_gemv_config(tq.QuantGemvConfig(True, 16, 128, 4, convert="half"))
    with pytest.raises(ValueError, match="integer codes"):
        tq.plan_quant_gemv("fp8", 1, 64, 64, 64, 132, replace(fma, convert="half"))
    tuned = tq.QuantGemvConfig(use_dot=True, block_n=16, block_k=64, num_warps=4)
    key = (132, "int8", 4, 4096, 4096)
    tq.QUANT_GEMV_TUNED[key] = tuned
    try:
        assert tq.plan_quant_gemv("int8", 3, 4096, 4096, 128, 132).config == tuned
    finally:
        del tq.QUANT_GEMV_TUNED[key]


def test_triton_fp8_row_quantization() -> None:
    assert tq is not None
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(3)) * 4
    xq, scale = tq.quantize_fp8_rows(x)
    ref_q, ref_scale = quant_ref.quantize_fp8_rows(x)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(xq.float(), ref_q.float())
    static_q, static_scale = tq.quantize_fp8_rows(x, 0.01)
    assert bool((static_scale == 0.01).all())
    expected = quant_ref.to_fp8(x, 0.01)
    assert torch.equal(static_q.float(), expected.float())
    # every rounding case: ties, the carry into the exponent, subnormals, saturation
    edge = torch.cat([torch.linspace(-500, 500, 4001), torch.linspace(-0.03, 0.03, 4001)])
    edge_q, _ = tq.quantize_fp8_rows(edge[None, :], 1.0)
    assert torch.equal(edge_q[0].float(), quant_ref.to_fp8(edge, 1.0).float())


def test_triton_attention_reads_an_fp8_cache() -> None:
    """write_kv_cache into fp8 caches with scales, then paged attention (prefill chunks and
    decodes) over them: the torch reference on the same fp8 caches."""
    assert ta is not None
    gen = torch.Generator().manual_seed(5)
    block_size, heads, kv_heads, dim = 4, 4, 2, 32
    cases = [(0, 7), (9, 1), (3, 5), (12, 1)]  # (cached tokens, new tokens)
    num_blocks = 16
    shape = (num_blocks, block_size, kv_heads, dim)
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[pool.pop() for _ in range(-(-(c + n) // block_size))] for c, n in cases]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)

    def slots(positions: str) -> torch.Tensor:  # every token's slot, or this step's new ones
        return torch.tensor([
            tables[r][p // block_size] * block_size + p % block_size
            for r, (c, n) in enumerate(cases)
            for p in (range(c + n) if positions == "all" else range(c, c + n))
        ])  # fmt: skip

    k, v = (torch.randn(len(slots("all")), kv_heads, dim, generator=gen) * 3 for _ in range(2))
    k_scale, v_scale = 0.02, 0.015
    caches = {}
    for name, write in (("triton", ta.write_kv_cache), ("torch", reference_write)):
        k_cache, v_cache = torch.zeros(shape, dtype=FP8_DTYPE), torch.zeros(shape, dtype=FP8_DTYPE)
        write(k, v, k_cache, v_cache, slots("all"), k_scale, v_scale)
        caches[name] = (k_cache, v_cache)
    for written, expected in zip(caches["triton"], caches["torch"]):
        assert torch.equal(written.float(), expected.float())
    k_cache, v_cache = caches["torch"]
    metadata = build_attention_metadata(
        torch.tensor([n for _, n in cases]), torch.tensor([c + n for c, n in cases]),
        block_tables, slots("new"), block_size, torch.device("cpu"),
    )  # fmt: skip
    q = torch.randn(metadata.num_tokens, heads, dim, generator=gen)
    expected = reference_attention(q, k_cache, v_cache, metadata, dim**-0.5, k_scale, v_scale)
    got = ta.paged_attention_backend(q, k_cache, v_cache, metadata, dim**-0.5, k_scale, v_scale)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)
    dense_k = k_cache.float() * k_scale
    float_ref = reference_attention(q, dense_k, v_cache.float() * v_scale, metadata, dim**-0.5)
    torch.testing.assert_close(expected, float_ref, atol=2e-5, rtol=0)
