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

import dataclasses
import importlib
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

from tests.interpreter import (
    fresh_process_test,
    interpret_triton,
    interpreted,
    skip_unless_interpreted,
)

IN_PROCESS = interpret_triton()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pagedserve.kernels.attention_backends import torch_ref_backend  # noqa: E402
from pagedserve.models import linear  # noqa: E402
from pagedserve.models.layer_config import LayerConfig  # noqa: E402
from pagedserve.models.loader import default_dtype  # noqa: E402

tg = interpreted("pagedserve.kernels.triton_gemv", "_skinny_linear_kernel", IN_PROCESS)
_kernels_in_this_process = skip_unless_interpreted(IN_PROCESS)
test_kernels_in_a_fresh_interpreter_process = fresh_process_test(__file__, IN_PROCESS)


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


# --------------------------------------------------------------------------- tuning


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _config(*args, **kwargs):
    return tg.SkinnyConfig(*args, **kwargs) if tg is not None else None


FORCED_CONFIGS = [  # (m, config): every knob of SkinnyConfig away from its default
    (1, _config(1, False, 1, 256, 1, 1, w_cache=".cg", w_evict="")),
    (1, _config(1, False, 2, 128, 2, 1, split_k=3, w_evict="")),
    (1, _config(1, False, 8, 64, 1, 1, split_k=16, w_evict="evict_last")),
    (2, _config(2, False, 4, 128, 1, 1, split_k=2, w_cache=".ca", w_evict="")),
    (3, _config(4, False, 1, 512, 2, 1, w_cache=".cv", w_evict="")),
    (8, _config(16, True, 16, 64, 1, 2, split_k=2, w_cache=".cg", w_evict="")),
]


@pytest.mark.parametrize("m,config", FORCED_CONFIGS)
def test_forced_config(m: int, config, monkeypatch: pytest.MonkeyPatch) -> None:
    """skinny_linear(config=...) launches exactly that config (blocks clamped to the problem,
    its split unless split_k says otherwise, its weight-load hints), whatever M's bucket and
    SKINNY_TUNED say; results as F.linear (bias, K tail: 600 = 4 x 128 + 88)."""
    monkeypatch.setattr(tg, "SKINNY_TUNED", {})
    x, weight, b = operands(m, 20, 600, torch.bfloat16, True, seed=m)
    plan = tg.plan_skinny_linear(m, 20, 600, tg._CPU_SMS, config=config)
    assert (plan.use_dot, plan.num_warps, plan.num_stages) == (
        config.use_dot, config.num_warps, config.num_stages)  # fmt: skip
    assert (plan.w_cache, plan.w_evict) == (config.w_cache, config.w_evict)
    assert plan.block_n == min(config.block_n, 32) and plan.block_k == config.block_k
    if config.split_k is not None:  # whole chunks a split, no empty split
        chunks = _cdiv(600, plan.block_k)
        assert plan.split_k == _cdiv(chunks, _cdiv(chunks, min(config.split_k, chunks)))
    out = tg.skinny_linear(x, weight, b, config=config)
    assert_matches_linear(out, x, weight, b)
    unsplit = tg.skinny_linear(x, weight, b, config=config, split_k=1)  # the keyword wins
    assert_matches_linear(unsplit, x, weight, b)
    assert not tg._counters(x.device).any()


def test_tuned_table_overrides_the_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SKINNY_TUNED entry (SM count, bucket, N, K) replaces the bucket's config for every M
    of the bucket on a GPU of that many SMs, 2-byte dtypes only; other shapes, SM counts,
    buckets and fp32 keep SKINNY_TUNING; split_k= still wins over the entry's split."""
    sms = tg._CPU_SMS
    tuned = tg.SkinnyConfig(4, False, 1, 64, 1, 1, split_k=2, w_cache=".cg", w_evict="")
    monkeypatch.setattr(tg, "SKINNY_TUNED", {(sms, 4, 12, 200): tuned})
    for m in (3, 4):
        plan = tg.plan_skinny_linear(m, 12, 200, sms)
        assert (plan.block_n, plan.block_k, plan.split_k, plan.w_cache) == (1, 64, 2, ".cg")
        assert tg.plan_skinny_linear(m, 12, 200, sms, split_k=1).split_k == 1
    bucket4 = next(c for c in tg.SKINNY_TUNING if c.max_m == 4)
    for args in [(2, 12, 200, sms), (4, 12, 200, 132), (4, 13, 200, sms), (4, 12, 208, sms)]:
        plan = tg.plan_skinny_linear(*args)
        assert plan.w_cache == "" and plan.w_evict == "evict_first", args
        if args[0] == 4:
            assert plan.block_n == min(bucket4.block_n, 16), args
    assert tg.plan_skinny_linear(4, 12, 200, sms, element_size=4).block_k == 256
    x, weight, b = operands(4, 12, 200, torch.bfloat16, True, seed=5)
    out = tg.skinny_linear(x, weight, b)
    assert_matches_linear(out, x, weight, b)
    assert torch.equal(out, tg.skinny_linear(x, weight, b, config=tuned))
    x32, w32, b32 = operands(4, 12, 200, torch.float32, True, seed=5)
    assert_matches_linear(tg.skinny_linear(x32, w32, b32), x32, w32, b32)


def test_bad_configs_are_rejected() -> None:
    """Non-power-of-two blocks or warps, no stages, a split of 0, unknown hints, and a cache
    modifier together with an eviction policy (ptxas rejects that load)."""
    x, weight, _ = operands(1, 8, 64, torch.bfloat16, False)
    good = tg.SkinnyConfig(1, False, 4, 64, 1, 1)
    bad = [
        ("block_n", {"block_n": 3}),
        ("block_k", {"block_k": 96}),
        ("num_warps", {"num_warps": 3}),
        ("stages", {"num_stages": 0}),
        ("split_k", {"split_k": 0}),
        ("w_cache", {"w_cache": ".cs", "w_evict": ""}),
        ("w_evict", {"w_evict": "evict_normal"}),
        ("exclude each other", {"w_cache": ".cg"}),
    ]
    for message, change in bad:
        config = dataclasses.replace(good, **change)
        with pytest.raises(ValueError, match=message):
            tg.check_skinny_config(config)
        with pytest.raises(ValueError, match=message):
            tg.skinny_linear(x, weight, config=config)
    for config in tg.SKINNY_TUNING:
        tg.check_skinny_config(config)


def _sweep_script() -> types.ModuleType:
    """scripts/gpu/sweep_gemv.py as a module (registered: its dataclasses need that)."""
    name = "sweep_gemv_under_test"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "sweep_gemv.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_sweep_candidates_and_tuned_literal(monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/gpu/sweep_gemv.py: its candidates are valid configs (the bucket default first),
    and the SKINNY_TUNED literal it prints is Python that fits ruff's 100 columns and gives
    back the measured plan once pasted."""
    sweep = _sweep_script()
    for m in (1, 2, 4, 8):
        blocks = sweep.block_configs(tg, m)
        default = next(c for c in tg.SKINNY_TUNING if m <= c.max_m)
        assert blocks[0] == dataclasses.replace(default, max_m=m) and len(blocks) >= 7, m
        for config in blocks + sweep.split_configs(blocks[:2]) + sweep.hint_configs(blocks[:2]):
            tg.check_skinny_config(config)
    monkeypatch.setattr(tg, "SKINNY_TUNED", {})
    shape = sweep.Shape("llama", "qkv", 6144, 4096)
    config = tg.SkinnyConfig(1, False, 1, 8192, 4, 1, w_cache=".cg", w_evict="")
    plan = tg.plan_skinny_linear(1, 6144, 4096, 132, config=config)
    current = tg.plan_skinny_linear(1, 6144, 4096, 132)
    best = sweep.Result("candidate", "hints", config, plan, us=12.0, confirm_us=[12.5])
    entry = {"m": 1, "shape": shape, "best": best, "results": [best],
             "current": sweep.Result("current", "ref", None, current, us=17.8),
             "cublas": sweep.Result("cublas", "ref", us=20.8)}  # fmt: skip
    text = sweep.tuned_literal(tg, [entry], 132, 0.02)
    assert all(len(line) <= 100 for line in text.splitlines()), text
    namespace = {"SkinnyConfig": tg.SkinnyConfig}
    exec(text, namespace)
    pinned = dataclasses.replace(config, block_k=4096, split_k=1)
    assert namespace["SKINNY_TUNED"] == {(132, 1, 6144, 4096): pinned}
    monkeypatch.setattr(tg, "SKINNY_TUNED", namespace["SKINNY_TUNED"])
    assert tg.plan_skinny_linear(1, 6144, 4096, 132) == plan
    assert tg.plan_skinny_linear(1, 6144, 4096, 114) == current  # another GPU: no entry
    entry["best"] = entry["current"]  # the current plan wins: the entry is kept, no new one
    again = sweep.tuned_literal(tg, [entry], 132, 0.02)
    kept = {"SkinnyConfig": tg.SkinnyConfig}
    exec(again, kept)
    assert kept["SKINNY_TUNED"] == namespace["SKINNY_TUNED"] and "# kept" in again


def test_sweep_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The sweep end to end on tiny shapes through the interpreter: every stage, the checks,
    the report and its JSON."""
    sweep = _sweep_script()
    out = tmp_path / "sweep.md"
    assert sweep.main(["--dry-run", "--top", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "constexpr sets (compiles)" in printed and "FAIL" not in printed
    report = out.read_text()
    assert "## Best config per shape" in report and "SKINNY_TUNED: dict" in report
    rows = json.loads(out.with_suffix(".json").read_text())
    stages = {row["stage"] for row in rows}
    assert {"ref", "blocks", "splits", "hints"} <= stages
    assert all(row["ok"] for row in rows) and sum(row["best"] for row in rows) == 2


# --------------------------------------------------------------------------- layer dispatch


def _spy_skinny(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, ...], bool]]:
    """skinny_linear's calls: (x's shape, dependent_launch); run without PDL (the CPU
    interpreter has none)."""
    calls: list[tuple[tuple[int, ...], bool]] = []
    original = tg.skinny_linear

    def spy(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        dependent_launch: bool = False,
    ) -> torch.Tensor:
        calls.append((tuple(x.shape), dependent_launch))
        return original(x, weight, bias)

    monkeypatch.setattr(tg, "skinny_linear", spy)
    return calls


def _linear_modules(
    dtype: torch.dtype, small_batch_gemm: bool, dependent_launch: bool = False, rows: int = 1
) -> list[tuple[torch.nn.Module, torch.Tensor | None]]:
    """A column- and a row-parallel layer with biases and an LM head (70 of 72 rows used),
    the same random weights for every config: (module, its bias)."""
    config = LayerConfig(
        torch.device("cpu"), dtype, torch_ref_backend(), fused_ops="triton",
        small_batch_gemm=small_batch_gemm, small_batch_gemm_rows=rows,
        dependent_launch=dependent_launch,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(11)
    with default_dtype(dtype):
        column = linear.ColumnParallelLinear(200, 72, config, bias=True)
        row = linear.RowParallelLinear(200, 72, config, bias=True)
        head = linear.LMHead(70, 200, config)
    for module in (column, row, head):
        for param in module.parameters():
            param.data.copy_(torch.randn(param.shape, generator=gen) / 10)
    return [(column, column.bias), (row, row.bias), (head, None)]


def test_linear_layers_dispatch_small_low_precision_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the Triton path and small_batch_gemm on (as on CUDA): bf16 batches of at most
    small_batch_gemm_rows rows (1 by default) go through skinny_linear in the linear layers and
    the LM head, larger batches through F.linear; with it off, nothing takes it."""
    assert linear.triton_gemv_module() is tg
    calls = _spy_skinny(monkeypatch)
    xb = torch.randn(20, 200, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    with torch.inference_mode():
        for module, _ in _linear_modules(torch.bfloat16, small_batch_gemm=False):
            module(xb[:1])
        assert calls == []
        for module, bias in _linear_modules(torch.bfloat16, small_batch_gemm=True):
            for rows in (1, 2, 16):
                out = module(xb[:rows])
                weight = module.weight[: out.shape[-1]]
                expected = F.linear(xb[:rows], module.weight, bias)[:, : out.shape[-1]]
                assert out.dtype == torch.bfloat16 and out.shape == expected.shape
                if rows == 1:
                    assert_matches_linear(out, xb[:rows], weight, bias)
                else:
                    assert torch.equal(out, expected)
        assert calls == [((1, 200), False)] * 3
        calls.clear()
        for module, _ in _linear_modules(torch.bfloat16, True, dependent_launch=True):
            module(xb[:1])
        assert calls == [((1, 200), True)] * 3  # the config's launch mode reaches the kernel
        calls.clear()
        for module, _ in _linear_modules(torch.bfloat16, True, rows=9):
            for rows in (1, 9, 10):
                module(xb[:rows])
        assert calls == [((1, 200), False), ((9, 200), False)] * 3
