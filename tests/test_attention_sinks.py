"""Attention sinks (GPT-OSS): a learned logit sink[h] per query head joins the softmax's
denominator only (kernels.attention_ref's module doc). The torch reference against a dense
computation by transformers' formula (the sink as an extra logit column, softmax, the column
dropped); the CPU backend and the Triton kernels (on the CPU through Triton's interpreter:
see test_triton_kernels.py for how it is chosen, and test_triton_attention_window.py) against
the reference; what no sinks, a huge sink and a vanishing one do; the Attention layer's sink
parameter and the backends that take it.

Steps come from test_triton_kernels.make_step (shuffled block tables, a cached context before
each request's new tokens). Tolerances as test_triton_kernels.py's: fp32 2e-5 absolute.
"""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.interpreter import (
    NOT_IN_PROCESS,
    fresh_process_test,
    interpret_triton,
    interpreted,
)

IN_PROCESS = interpret_triton()

import torch  # noqa: E402

from pagedserve.kernels import attention_ref  # noqa: E402
from pagedserve.kernels.attention_backends import (  # noqa: E402
    AttentionBackend,
    resolve_attention_backend,
    torch_ref_backend,
)
from pagedserve.kernels.attention_ref import paged_attention as reference_attention  # noqa: E402
from pagedserve.kernels.cpu_attention import paged_attention_head_major  # noqa: E402
from pagedserve.models.layer_config import LayerConfig, TensorParallel  # noqa: E402
from pagedserve.models.layers import Attention  # noqa: E402
from tests.test_triton_kernels import MIXED, make_step  # noqa: E402

ta = interpreted("pagedserve.kernels.triton_attention", "_prefill_kernel", IN_PROCESS)
test_kernels_in_a_fresh_interpreter_process = fresh_process_test(__file__, IN_PROCESS)

ATOL = 2e-5
CPU = torch.device("cpu")
# prefill chunks after earlier context (chunked prefill), a fresh prompt, a decode
CHUNKED = [(70, 10), (37, 20), (3, 2), (0, 30), (150, 9), (20, 1)]
# long decodes cut into 64-key tiles: 4 forced splits give 3 (2 tiles each), and the short
# requests' later splits hold no key
LONG_DECODES = [(300, 1), (129, 1), (40, 1), (5, 1), (0, 1)]
WINDOW_SOFTCAP = [(0, 0.0), (6, 0.0), (0, 2.0), (24, 3.0)]


def triton_kernels() -> ModuleType:
    """triton_attention with its kernels interpreted (the test skips when they cannot be)."""
    if ta is None:
        pytest.skip(NOT_IN_PROCESS)
    return ta


def sink_logits(num_heads: int, seed: int) -> torch.Tensor:
    """[num_heads] float32 sinks from far below to above the log of a context's total weight."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_heads, generator=gen) * 2.0 + 1.0


def dense_attention(
    step: dict,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """transformers' eager attention, request by request in float64: causal scores over the
    request's whole context (read back from the step's cache), capped and windowed; with sinks,
    GPT-OSS's softmax (the sink as one more logit column, dropped after the softmax)."""
    q, metadata = step["q"], step["metadata"]
    k_cache, v_cache = step["k_cache"], step["v_cache"]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    start = 0
    lens = zip(metadata.query_lens_cpu.tolist(), metadata.seq_lens_cpu.tolist())
    for row, (q_len, seq_len) in enumerate(lens):
        keys_at = torch.arange(seq_len)
        blocks = metadata.block_tables_cpu[row, keys_at // block_size].long()
        keys = k_cache[blocks, keys_at % block_size].double().repeat_interleave(group, dim=1)
        values = v_cache[blocks, keys_at % block_size].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start : start + q_len].double(), keys) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        query_at = (seq_len - q_len + torch.arange(q_len))[:, None]
        hidden = keys_at[None, :] > query_at
        if window:
            hidden |= keys_at[None, :] <= query_at - window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            sink_column = sinks.double()[:, None, None].expand(-1, q_len, 1)
            probs = torch.cat((scores, sink_column), dim=-1).softmax(-1)[..., :-1]
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", probs, values)
        start += q_len
    return out


def run_backend(
    backend: str, step: dict, num_splits: int | None = None, **options: object
) -> torch.Tensor:
    """The step's attention output through a backend ("reference"; "cpu": the head-major one;
    "cpu_kernel": the same asked to use its C++ decode kernel; "triton"). options: window,
    softcap, sinks (and for Triton its launch keywords); num_splits: Triton's decode splits."""
    q, k_cache, v_cache, metadata = step["q"], step["k_cache"], step["v_cache"], step["metadata"]
    scale = q.shape[-1] ** -0.5
    if backend == "reference":
        return reference_attention(q, k_cache, v_cache, metadata, scale, **options)
    if backend.startswith("cpu"):
        k_cache, v_cache = (c.permute(2, 0, 1, 3).contiguous() for c in (k_cache, v_cache))
        use_kernel = backend == "cpu_kernel"
        return paged_attention_head_major(
            q, k_cache, v_cache, metadata, scale, use_kernel=use_kernel, **options
        )
    return triton_kernels().paged_attention(
        q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
        metadata.max_query_len, scale, max_seq_len=metadata.max_seq_len, num_splits=num_splits,
        **options,
    )  # fmt: skip


def assert_matches_reference(
    backend: str,
    step: dict,
    window: int = 0,
    softcap: float = 0.0,
    num_splits: int | None = None,
) -> None:
    """`backend` with random sinks equals the reference with them (which the sinks change)."""
    sinks = sink_logits(step["q"].shape[1], seed=window + 7)
    options = {"window": window, "softcap": softcap}
    got = run_backend(backend, step, num_splits, sinks=sinks, **options)
    expected = run_backend("reference", step, sinks=sinks, **options)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert (expected - run_backend("reference", step, **options)).abs().max() > 0.05


# --------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("window,softcap", WINDOW_SOFTCAP)
@pytest.mark.parametrize(
    "block_size,num_heads,num_kv_heads",
    [(4, 4, 4), (16, 8, 2), (1, 6, 2)],  # MHA, GQA 4 in blocks of 16, GQA 3 a token a block
)
def test_reference_equals_transformers_sink_softmax(
    block_size: int, num_heads: int, num_kv_heads: int, window: int, softcap: float
) -> None:
    """Fresh prompts, chunks after a cached context and decodes in one step."""
    step = make_step(MIXED, block_size, num_heads, num_kv_heads, 32, torch.float32, seed=window)
    scale = 32**-0.5
    sinks = sink_logits(num_heads, seed=block_size)
    options = {"window": window, "softcap": softcap}
    got = run_backend("reference", step, sinks=sinks, **options)
    expected = dense_attention(step, scale, sinks=sinks, **options)
    torch.testing.assert_close(got.double(), expected, atol=ATOL, rtol=0)
    assert (expected - dense_attention(step, scale, **options)).abs().max() > 0.05


def test_sink_softmax_of_a_row_without_keys_is_zero() -> None:
    """The max is taken over the sink too: a row whose keys are all masked gives 0, not NaN;
    a finite row's weights and its sink's share sum to 1."""
    scores = torch.tensor([[float("-inf")] * 3, [0.5, float("-inf"), -1.0]])
    sinks = torch.tensor([[2.0], [0.25]])
    probs = attention_ref.softmax_with_sinks(scores, sinks)
    assert probs[0].tolist() == [0.0, 0.0, 0.0]
    expected = torch.tensor([0.5, float("-inf"), -1.0, 0.25]).softmax(-1)
    torch.testing.assert_close(probs[1], expected[:3], atol=1e-7, rtol=0)


def test_the_first_query_of_a_prompt_weighs_its_one_key_against_the_sink() -> None:
    """A prompt's first token attends only its own key j: out = v_j e^s / (e^s + e^sink),
    i.e. v_j sigmoid(s - sink)."""
    step = make_step([(0, 3)], 4, 2, 1, 16, torch.float32, seed=4)
    q, k_cache, v_cache = step["q"], step["k_cache"], step["v_cache"]
    block = int(step["metadata"].block_tables_cpu[0, 0])
    sinks = torch.tensor([0.5, -1.0])
    out = run_backend("reference", step, sinks=sinks)
    score = (q[0] @ k_cache[block, 0, 0]) * 16**-0.5  # [2 heads]
    expected = torch.sigmoid(score - sinks)[:, None] * v_cache[block, 0, 0]
    torch.testing.assert_close(out[0], expected, atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- the CPU backend


@pytest.mark.parametrize("window,softcap", WINDOW_SOFTCAP)
def test_cpu_backend_equals_the_reference(window: int, softcap: float) -> None:
    step = make_step(MIXED, 4, 8, 2, 32, torch.float32, seed=window + 1)
    assert_matches_reference("cpu", step, window, softcap)


def test_cpu_sinks_never_reach_the_cpp_decode_kernel() -> None:
    """A float32 decode-only step of the shapes the C++ kernel takes, use_kernel on: the sinks
    still apply (the kernel, if it ran, would leave them out; unloaded, its op is missing)."""
    step = make_step(LONG_DECODES, 16, 8, 2, 32, torch.float32, seed=2)
    assert_matches_reference("cpu_kernel", step)


# --------------------------------------------------------------------------- the Triton kernels


@pytest.mark.parametrize("window", [0, 24])
def test_triton_prefill_equals_the_reference(window: int) -> None:
    """Chunks after cached context in 16-row tiles of 16 keys (blocks of 4 tokens), longest
    first; with a window some tiles are masked below it."""
    kernels = triton_kernels()
    step = make_step(CHUNKED, 4, 4, 2, 32, torch.float32, seed=window + 3)
    sinks = sink_logits(4, seed=window)
    tiles = kernels.PrefillTiles(16, 16, num_warps=4, num_stages=2)
    options = {"window": window, "sinks": sinks}
    got = run_backend("triton", step, prefill_tiles=tiles,
                      longest_first=step["metadata"].longest_first, **options)  # fmt: skip
    torch.testing.assert_close(got, run_backend("reference", step, **options), atol=ATOL, rtol=0)
    assert (got - run_backend("triton", step, window=window)).abs().max() > 0.05


@pytest.mark.parametrize(
    "window,num_splits",
    [
        (0, 1),  # one split: the decode kernel joins the sink before it normalises
        (0, 4),  # 3 splits of 2 tiles: the reduce joins it once; short requests' are empty
        (100, 4),  # the window's tiles only, split up; some splits hold no key
        (100, 1),
    ],
)
def test_triton_decode_equals_the_reference(window: int, num_splits: int) -> None:
    step = make_step(LONG_DECODES, 16, 4, 2, 32, torch.float32, seed=window + num_splits)
    assert_matches_reference("triton", step, window, num_splits=num_splits)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,window,softcap",
    [
        (8, 2, 32, 5, 10.0),  # GQA 4, a window inside a block, a softcap
        (6, 2, 24, 19, 0.0),  # group 3, head_dim 24: padded rows and dims
    ],
)
def test_triton_mixed_batch_equals_the_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, window: int, softcap: float
) -> None:
    """Fresh prompts, chunks after a cached prefix and decodes in one step (default tiles)."""
    step = make_step(MIXED, 4, num_heads, num_kv_heads, head_dim, torch.float32, seed=window)
    assert_matches_reference("triton", step, window, softcap)


def test_triton_rejects_bad_sinks() -> None:
    kernels = triton_kernels()
    step = make_step([(3, 2)], 4, 4, 2, 16, torch.float32, seed=1)
    q, k_cache, v_cache, md = step["q"], step["k_cache"], step["v_cache"], step["metadata"]
    args = (md.block_tables, md.seq_lens, md.query_start_loc, md.max_query_len, 1.0)
    for sinks, message in (
        (torch.zeros(2), "num_heads"),
        (torch.zeros(4, dtype=torch.bfloat16), "float32"),
        (torch.zeros(8)[::2], "contiguous"),
    ):
        with pytest.raises(ValueError, match=message):
            kernels.paged_attention(q, k_cache, v_cache, *args, sinks=sinks)


# --------------------------------------------------------------------------- what sinks do

BACKENDS = ["reference", "cpu", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_sinks_equal_sinks_at_minus_infinity(backend: str) -> None:
    """sinks=None (the default) gives what a sink of weight e^-inf = 0 gives: bit for bit in
    the Triton kernels (one split and several), within rounding elsewhere (the reference's
    and the CPU backend's paths without options are other algorithms)."""
    step = make_step(MIXED, 4, 4, 2, 16, torch.float32, seed=5)
    minus_inf = torch.full((4,), float("-inf"))
    for num_splits in (1, 3) if backend == "triton" else (None,):
        plain = run_backend(backend, step, num_splits)
        sunk = run_backend(backend, step, num_splits, sinks=minus_inf)
        if backend == "triton":
            assert torch.equal(plain, sunk)
        else:
            torch.testing.assert_close(plain, sunk, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "num_splits,with_sinks,joins", [(1, False, 0), (1, True, 10), (3, True, 0)]
)
def test_triton_decode_joins_the_sinks_once(
    monkeypatch: pytest.MonkeyPatch, num_splits: int, with_sinks: bool, joins: int
) -> None:
    """The decode kernel joins the sinks (once a program: 5 requests x 2 kv heads) only with
    sinks and one split; with several the reduce joins them, once (the numbers: above)."""
    kernels = triton_kernels()
    step = make_step(LONG_DECODES, 16, 4, 2, 16, torch.float32, seed=11)
    calls = []
    original = kernels._join_sinks
    monkeypatch.setattr(kernels, "_join_sinks", lambda *args: calls.append(1) or original(*args))
    sinks = sink_logits(4, seed=11) if with_sinks else None
    run_backend("triton", step, num_splits, sinks=sinks)
    assert len(calls) == joins


def test_the_reference_without_options_keeps_its_sdpa_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """sinks=None with no window or softcap: SDPA, as before sinks; sinks: the explicit path."""
    step = make_step(MIXED, 4, 4, 2, 16, torch.float32, seed=6)

    def explicit(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("explicit path")

    monkeypatch.setattr(attention_ref, "_attend_group_explicit", explicit)
    run_backend("reference", step)
    with pytest.raises(AssertionError, match="explicit path"):
        run_backend("reference", step, sinks=torch.zeros(4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_huge_sink_silences_a_head_and_a_vanishing_one_changes_nothing(backend: str) -> None:
    """Head 0's sink +40 outweighs every key (its output ~ 0); head 1's -40 weighs nothing
    (its output as without sinks); prefill and decode rows."""
    step = make_step(MIXED, 4, 2, 1, 16, torch.float32, seed=9)
    plain = run_backend(backend, step, num_splits=2)
    out = run_backend(backend, step, num_splits=2, sinks=torch.tensor([40.0, -40.0]))
    assert plain[:, 0].abs().max() > 0.1
    assert out[:, 0].abs().max() < 1e-9
    torch.testing.assert_close(out[:, 1], plain[:, 1], atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- the layer


def layer_config(backend: AttentionBackend, tp: TensorParallel | None = None) -> LayerConfig:
    return LayerConfig(CPU, torch.float32, backend, tp=tp or TensorParallel())


def test_a_backend_without_windows_refuses_a_layer_with_sinks() -> None:
    """The CUDA decode kernel takes no sinks: its backend (windowed False) refuses them, and
    a model with them resolves 'cuda' to Triton's backend."""
    reference = torch_ref_backend()
    no_options = AttentionBackend("cuda", reference.attend, reference.write_kv_cache,
                                  windowed=False)  # fmt: skip
    Attention(4, 16, 0.25, 2, layer_config(no_options))  # no sinks: fine
    with pytest.raises(ValueError, match="attention sinks"):
        Attention(4, 16, 0.25, 2, layer_config(no_options), sinks=True)
    assert resolve_attention_backend("cuda", windowed=True).name == "triton"


def test_the_sinks_parameter_takes_this_ranks_heads() -> None:
    """Rank 1 of 2 with 3 local heads: heads 3..5 of the checkpoint's 6, as float32."""
    config = layer_config(torch_ref_backend(), TensorParallel(rank=1, size=2))
    layer = Attention(3, 16, 0.25, 1, config, sinks=True)
    assert layer.sinks is not None and layer.sinks.dtype == torch.float32
    checkpoint = torch.tensor([0.5, 1.5, 2.5, 3.5, 4.5, 5.5], dtype=torch.bfloat16)
    layer.sinks.weight_loader(layer.sinks, checkpoint)
    assert layer.sinks.tolist() == [3.5, 4.5, 5.5]
    with pytest.raises(ValueError, match="6 heads"):
        layer.sinks.weight_loader(layer.sinks, torch.zeros(3))
    assert Attention(3, 16, 0.25, 1, config).sinks is None


def test_the_layer_attends_with_its_sinks() -> None:
    step = make_step(MIXED, 4, 4, 2, 16, torch.float32, seed=10)
    q, metadata = step["q"], step["metadata"]
    layer = Attention(4, 16, 16**-0.5, 2, layer_config(torch_ref_backend()), sinks=True)
    assert layer.sinks is not None
    layer.sinks.data.copy_(sink_logits(4, seed=10))
    layer.k_cache, layer.v_cache = step["k_cache"], step["v_cache"]
    flat = q.reshape(len(q), -1)
    out = layer(flat, flat[:, :32], flat[:, :32], metadata, kv_written=True)
    expected = run_backend("reference", step, sinks=layer.sinks.detach())
    torch.testing.assert_close(out, expected.reshape(len(q), -1), atol=1e-6, rtol=0)
    assert (expected - run_backend("reference", step)).abs().max() > 0.05
