"""The skinny weight-streaming GEMM (pagedserve.kernels.triton_gemv) against F.linear, on the CPU
through Triton's interpreter (TRITON_INTERPRET=1; see test_triton_kernels.py for how the
interpreter is chosen and the fresh-process fallback), and the linear layers' dispatch to it.

Tolerances: fp32 within 1e-5 of F.linear in fp32 (outputs are O(1)); fp16/bf16 against
F.linear in fp32 rounded once to the dtype: within one unit in the last place everywhere and
exact almost everywhere (the sums differ only in fp32 summation order, so a value lands on the
other side of a rounding boundary rarely; a truncating or twice-rounding kernel would miss
about half the values).
"""

from __future__ import annotations

import importlib
import os

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

from pagedserve.models import layers  # noqa: E402
from tests.interpreter import assert_passes_in_fresh_interpreter  # noqa: E402

IN_PROCESS = isinstance(_tl_standard.sum, InterpretedFunction)
if not IN_PROCESS:
    if _PREVIOUS_INTERPRET is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _PREVIOUS_INTERPRET
    tg = None
else:
    tg = importlib.import_module("pagedserve.kernels.triton_gemv")
    assert isinstance(tg._skinny_linear_kernel, InterpretedFunction)

FRESH_PROCESS_TEST = "test_kernels_in_a_fresh_interpreter_process"


@pytest.fixture(autouse=True)
def _kernels_in_this_process(request: pytest.FixtureRequest) -> None:
    if not IN_PROCESS and request.node.originalname != FRESH_PROCESS_TEST:
        pytest.skip("triton was imported in compiled mode: see " + FRESH_PROCESS_TEST)


def test_kernels_in_a_fresh_interpreter_process() -> None:
    """This file in a fresh process, when triton was imported too early to interpret here."""
    if IN_PROCESS:
        pytest.skip("the kernels run in this process")
    assert_passes_in_fresh_interpreter(__file__)


MANTISSA_BITS = {torch.bfloat16: 8, torch.float16: 11}  # significant bits, implicit one included


def operands(
    m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [m, k] ~ N(0, 1), weight [n, k] ~ N(0, 1 / k) (outputs O(1)), bias [n] or None."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, weight, b


def assert_matches_linear(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    expected32 = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert out.dtype == x.dtype and out.shape == (*x.shape[:-1], weight.shape[0])
    if x.dtype == torch.float32:
        torch.testing.assert_close(out, expected32, rtol=1e-5, atol=1e-5)
        return
    expected = expected32.to(x.dtype).float()
    _, exponent = torch.frexp(expected)
    ulp = torch.ldexp(torch.ones_like(expected), exponent - MANTISSA_BITS[x.dtype])
    diff = (out.float() - expected).abs()
    assert bool((diff <= ulp).all()), f"max error {float((diff / ulp).max()):.2f} ulp"
    assert float((diff > 0).float().mean()) <= 0.02, "rounded more than once, or not to nearest"


# --------------------------------------------------------------------------- the kernel


@pytest.mark.parametrize("m", [1, 2, 5, 16])
@pytest.mark.parametrize("n,k", [(72, 200), (40, 1040)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_f_linear(
    m: int, n: int, k: int, dtype: torch.dtype, bias: bool
) -> None:
    """Both inner loops (fma: M <= 4, dot: M > 4), N and K tails (72 rows over blocks of 4 and
    32, K = 200 and 1040 over chunks of 1024 / 256 / 128), with and without a bias."""
    x, weight, b = operands(m, n, k, dtype, bias, seed=m + k)
    assert_matches_linear(tg.skinny_linear(x, weight, b), x, weight, b)


@pytest.mark.parametrize("m", [1, 3, 16])
def test_skinny_linear_fp16(m: int) -> None:
    x, weight, b = operands(m, 48, 96, torch.float16, True, seed=m)
    assert_matches_linear(tg.skinny_linear(x, weight, b), x, weight, b)


SMALL_BLOCKS = (
    tg.SkinnyConfig(max_m=1, use_dot=False, block_n=4, block_k=32, num_warps=1, num_stages=1),
    tg.SkinnyConfig(max_m=4, use_dot=False, block_n=2, block_k=32, num_warps=1, num_stages=1),
    tg.SkinnyConfig(max_m=16, use_dot=True, block_n=16, block_k=32, num_warps=1, num_stages=1),
) if tg is not None else ()  # fmt: skip


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_k", [None, 5, 64])
def test_split_k(
    m: int, dtype: torch.dtype, split_k: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small blocks (K = 200 is 7 chunks of 32, the last partial) on 32 stand-in SMs:
    automatic and forced splits (64: clamped to one chunk a split), the last-arriving program's
    reduction, the counters left at zero, and repeatable bits."""
    monkeypatch.setattr(tg, "SKINNY_TUNING", SMALL_BLOCKS)
    monkeypatch.setattr(tg, "_CPU_SMS", 32)
    x, weight, b = operands(m, 12, 200, dtype, True, seed=m)
    plan = tg.plan_skinny_linear(m, 12, 200, 32, split_k, x.element_size())
    if split_k is None:  # a few tiles: split, unless the fp32 partials of 16 rows would cost
        # more than half the bytes of a bf16 weight this short
        assert (plan.split_k > 1) == (m < 16 or dtype == torch.float32), plan
    else:
        assert plan.split_k == {5: 4, 64: 7}[split_k]
    out = tg.skinny_linear(x, weight, b, split_k=split_k)
    assert_matches_linear(out, x, weight, b)
    assert torch.equal(tg.skinny_linear(x, weight, b, split_k=split_k), out)  # deterministic
    assert not tg._counters(x.device).any()


def test_strided_and_batched_x() -> None:
    """x rows strided (a view of a wider buffer, every other row) and leading batch dims."""
    gen = torch.Generator().manual_seed(7)
    buffer = torch.randn(10, 200 + 24, generator=gen).to(torch.bfloat16)
    _, weight, b = operands(1, 72, 200, torch.bfloat16, True)
    for x in (buffer[:5, :200], buffer[::2, 8:208], buffer[3:4, :200]):
        assert x.stride(0) > 200
        assert_matches_linear(tg.skinny_linear(x, weight, b), x, weight, b)
    x3 = buffer[:6, :200].reshape(2, 3, 200)
    out = tg.skinny_linear(x3, weight, b)
    assert out.shape == (2, 3, 72)
    assert_matches_linear(out, x3, weight, b)
    empty = tg.skinny_linear(buffer[:0, :200], weight)
    assert empty.shape == (0, 72)


def test_skinny_linear_rejects_bad_arguments() -> None:
    x, w, b = operands(2, 8, 32, torch.float32, True)
    bad_calls: list[tuple[str, tuple, dict]] = [
        ("dtype", (x.double(), w.double()), {}),
        ("weight dtype", (x, w.half()), {}),
        ("weight must be \\[N, K\\]", (x, w[0]), {}),
        ("contiguous", (x, w.t().contiguous().t()), {}),
        ("contiguous", (x, torch.zeros(8, 64)[:, ::2]), {}),
        ("weight's K", (x[:, :16], w), {}),
        ("more than SKINNY_MAX_M", (torch.zeros(17, 32), w), {}),
        ("along K", (torch.zeros(32, 2).t(), w), {}),
        ("bias must be", (x, w, b[:4]), {}),
        ("bias dtype", (x, w, b.half()), {}),
        ("bias must be contiguous", (x, w, torch.zeros(8, 2)[:, 0]), {}),
        ("split_k", (x, w), {"split_k": 0}),
        ("N and K", (torch.zeros(2, 0), torch.zeros(8, 0)), {}),
    ]
    for message, args, kwargs in bad_calls:
        with pytest.raises(ValueError, match=message):
            tg.skinny_linear(*args, **kwargs)
        if not kwargs:
            assert not tg.skinny_linear_applies(*args), message
    assert tg.skinny_linear_applies(x, w, b)
    assert tg.skinny_linear_applies(torch.zeros(16, 32), w)
    assert not tg.skinny_linear_applies(torch.zeros(0, 32), w)


def test_plans_fill_an_h200() -> None:
    """Shapes only: on 132 SMs every projection of N >= 1024 runs >= ~2 programs per SM, with
    K splits where the tiles alone are too few, each a whole number of chunks."""
    for m in (1, 2, 4, 8, 16):
        for n, k in [(1024, 1024), (1024, 2048), (1024, 3072), (1024, 6144), (4096, 1024),
                     (6144, 1024), (4096, 14336), (151936, 1024)]:  # fmt: skip
            plan = tg.plan_skinny_linear(m, n, k, 132)
            assert plan.programs >= 256, (m, n, k, plan)
            assert plan.k_per_split % plan.block_k == 0 and plan.split_k <= tg.SKINNY_MAX_SPLIT_K
            assert (plan.split_k - 1) * plan.k_per_split < k <= plan.split_k * plan.k_per_split
            assert plan.use_dot == (m > 4) and plan.tiles * plan.block_n >= n


# --------------------------------------------------------------------------- layer dispatch


def _spy_skinny(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    calls: list[tuple[int, ...]] = []
    original = tg.skinny_linear

    def spy(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return original(x, weight, bias)

    monkeypatch.setattr(tg, "skinny_linear", spy)
    return calls


def test_linear_layers_dispatch_small_low_precision_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the Triton path forced on (as on CUDA): bf16 batches of at most
    SMALL_BATCH_GEMM_MAX_ROWS rows go through skinny_linear in the linear layers and the LM
    head, larger batches and fp32 through F.linear; without it (the CPU), nothing changes."""
    assert layers.SMALL_BATCH_GEMM_MAX_ROWS == 1
    assert layers.triton_gemv_module() is tg
    calls = _spy_skinny(monkeypatch)
    gen = torch.Generator().manual_seed(11)
    replicated = layers.ReplicatedLinear(200, 72, bias=True)
    row = layers.RowParallelLinear(200, 72, bias=True)
    head = layers.LMHead(70, 200)
    for module in (replicated, row, head):
        for param in module.parameters():
            param.data.copy_(torch.randn(param.shape, generator=gen) / 10)
    x = torch.randn(20, 200, generator=gen)
    modules = [(replicated, replicated.bias), (row, row.bias), (head, None)]
    with torch.inference_mode():
        plain = [module(x[:3]) for module, _ in modules]  # CPU: fp32 oneDNN / F.linear
        assert calls == []
        monkeypatch.setattr(layers, "use_triton_ops", lambda x: True)
        for (module, _), before in zip(modules, plain):
            assert torch.equal(module(x[:3]), before)  # fp32: unchanged
        assert calls == []
        for module, _ in modules:
            module.to(torch.bfloat16)
        xb = x.to(torch.bfloat16)
        for module, bias in modules:
            for rows in (1, 2, 16):
                out = module(xb[:rows])
                weight = module.weight[: out.shape[-1]]
                expected = F.linear(xb[:rows], module.weight, bias)[:, : out.shape[-1]]
                assert out.dtype == torch.bfloat16 and out.shape == expected.shape
                if rows == 1:
                    assert_matches_linear(out, xb[:rows], weight, bias)
                else:
                    assert torch.equal(out, expected)
        assert calls == [(1, 200)] * 3


def test_small_batch_gemm_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """EngineConfig.small_batch_gemm=False (enable_small_batch_gemm) keeps cuBLAS / F.linear."""
    calls = _spy_skinny(monkeypatch)
    monkeypatch.setattr(layers, "use_triton_ops", lambda x: True)
    linear = layers.ReplicatedLinear(200, 72, bias=False).to(torch.bfloat16)
    linear.weight.data.copy_(torch.randn(72, 200, generator=torch.Generator().manual_seed(3)))
    x = torch.randn(1, 200, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    try:
        layers.enable_small_batch_gemm(False)
        with torch.inference_mode():
            assert torch.equal(linear(x), F.linear(x, linear.weight))
        assert calls == []
    finally:
        layers.enable_small_batch_gemm(True)
    with torch.inference_mode():
        linear(x)
    assert calls == [(1, 200)]
