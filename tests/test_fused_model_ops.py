"""The model layers' Triton path (RMSNorm, fused add + RMSNorm, SiLU-and-mul, and the
attention's q/k norm + rotary in one launch), run on CPU tensors through Triton's interpreter
(a LayerConfig with fused_ops "triton"), against the pure-torch path: tiny Llama and Qwen3 models
give the same hidden states over a prefill step and a decode step. Also: every forward looks the
rotary tables up again (the CUDA-graph capture hazard).

conftest.py sets TRITON_INTERPRET=1 before triton is imported; when triton was imported in
compiled mode anyway (or is missing), the Triton tests here are skipped."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from pagedserve.config import EngineConfig
from pagedserve.kernels.attention_backends import AttentionBackend, resolve_attention_backend
from pagedserve.kernels.attention_metadata import AttentionMetadata, build_attention_metadata
from pagedserve.models import layers
from pagedserve.models.layer_config import FusedOps, LayerConfig
from pagedserve.models.loader import load_model
from tests.tiny_models import save_tiny_model


def _triton_interpreted() -> bool:
    try:
        import triton.language.standard as tl_standard
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(tl_standard.sum, InterpretedFunction)


needs_interpreter = pytest.mark.skipif(
    not _triton_interpreted(), reason="triton missing, or imported without TRITON_INTERPRET=1"
)

BLOCK_SIZE = 4
NUM_BLOCKS = 8
BACKEND = "torch_ref"  # token-major torch attention: no C++ kernel on either path
ModelFactory = Callable[[str, AttentionBackend, FusedOps], nn.Module]


@pytest.fixture(scope="module")
def make_model(tmp_path_factory: pytest.TempPathFactory) -> ModelFactory:
    """make_model(arch, attention backend, fused_ops): tiny float32 Llama or Qwen3 (head_dim
    32) with random norm weights (q_norm and k_norm differ), the same weights on every call,
    loaded the way the engine does with that attention backend and those per-token ops."""
    paths: dict[str, Path] = {}
    for seed, arch in enumerate(("llama", "qwen3")):
        directory = tmp_path_factory.mktemp(arch)
        paths[arch] = save_tiny_model(arch, directory, seed=seed, hidden_size=128)

    def make(arch: str, backend: AttentionBackend, fused_ops: FusedOps) -> nn.Module:
        cpu = torch.device("cpu")
        layer_config = LayerConfig(cpu, torch.float32, backend, fused_ops=fused_ops)
        model = load_model(EngineConfig(model=str(paths[arch])), layer_config.device, layer_config)
        gen = torch.Generator().manual_seed(len(arch))
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.data.copy_(1 + 0.3 * torch.randn(param.shape, generator=gen))
        return model

    return make


def _metadata(query_lens: list[int], seq_lens: list[int], slots: list[int]) -> AttentionMetadata:
    """Request 0 in blocks 3, 0; request 1 in block 5."""
    return build_attention_metadata(
        torch.tensor(query_lens),
        torch.tensor(seq_lens),
        torch.tensor([[3, 0], [5, 0]], dtype=torch.int32),
        torch.tensor(slots),
        BLOCK_SIZE,
        torch.device("cpu"),
    )


def _steps(vocab_size: int) -> list[tuple[torch.Tensor, torch.Tensor, AttentionMetadata]]:
    """A prefill of two prompts (5 and 3 tokens), then a decode step of both."""
    gen = torch.Generator().manual_seed(1)
    prefill_ids = torch.randint(1, vocab_size, (8,), generator=gen)
    prefill = (
        prefill_ids,
        torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]),
        _metadata([5, 3], [5, 3], [12, 13, 14, 15, 0, 20, 21, 22]),
    )
    decode_ids = torch.randint(1, vocab_size, (2,), generator=gen)
    decode = (decode_ids, torch.tensor([5, 3]), _metadata([1, 1], [6, 4], [1, 23]))
    return [prefill, decode]


def _run(model: nn.Module, steps: list) -> list[torch.Tensor]:
    """The steps' hidden states, on fresh zeroed KV caches."""
    for module in model.modules():
        if isinstance(module, layers.Attention):
            shape = module.backend.kv_cache_layer_shape(
                NUM_BLOCKS, BLOCK_SIZE, module.num_kv_heads, module.head_dim
            )
            module.k_cache, module.v_cache = torch.zeros(shape), torch.zeros(shape)
    with torch.inference_mode():
        return [model(input_ids, positions, metadata) for input_ids, positions, metadata in steps]


def _spy(monkeypatch: pytest.MonkeyPatch, module: object, name: str, calls: list) -> None:
    original: Callable = getattr(module, name)

    def spy(*args: object, **kwargs: object) -> object:
        calls.append((name, args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)


@needs_interpreter
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("backend", [BACKEND, "triton"])
def test_triton_path_matches_torch_path(
    arch: str, backend: str, make_model: ModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """backend triton (its cache layout): the q/k rotary launch also writes the KV cache,
    and no separate cache write is launched."""
    attention = resolve_attention_backend(backend)
    assert attention.name == backend
    model = make_model(arch, attention, "torch")
    steps = _steps(model.config.vocab_size)
    expected = _run(model, steps)

    triton_ops = layers.triton_ops_module()
    calls: list[tuple[str, tuple, dict]] = []
    for name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "qk_norm_rotary_"):
        _spy(monkeypatch, triton_ops, name, calls)
    writes: list[tuple] = []
    writer = attention.write_kv_cache
    spied = dataclasses.replace(
        attention, write_kv_cache=lambda *args: writes.append(args) or writer(*args)
    )
    got = _run(make_model(arch, spied, "triton"), steps)

    for hidden, reference in zip(got, expected):
        torch.testing.assert_close(hidden, reference, atol=1e-4, rtol=0)
    # per step of a 2-layer model: 1 rms_norm, 4 fused add + norm (in place), 2 SiLU-and-mul,
    # 2 q/k launches, with the norm weights on Qwen3 only: nothing fell back to torch
    names = [name for name, _, _ in calls]
    expected_counts = {"rms_norm": 1, "fused_add_rms_norm": 4, "silu_and_mul": 2}
    expected_counts["qk_norm_rotary_"] = 2
    for name, count in expected_counts.items():
        assert names.count(name) == count * len(steps), name
    assert all(args[-1] is True for name, args, _ in calls if name == "fused_add_rms_norm")
    qk_calls = [(args, kwargs) for name, args, kwargs in calls if name == "qk_norm_rotary_"]
    for args, kwargs in qk_calls:
        assert kwargs["num_q_heads"] == 4
        assert (args[4] is not None) == (arch == "qwen3")
        assert (kwargs["kv_write"] is not None) == (backend == "triton")
    assert len(writes) == (0 if backend == "triton" else 2 * len(steps))


def test_each_forward_looks_the_rotary_tables_up_again(make_model: ModelFactory) -> None:
    """Two forwards with the same positions tensor, edited in place between them (as a CUDA
    graph's static buffer is; an inference tensor has no version counter): the second forward
    must rotate with the new positions, not the first forward's cached tables."""
    # rotates through the per-step tables on this path
    model = make_model("qwen3", resolve_attention_backend(BACKEND), "torch")
    input_ids, _, metadata = _steps(model.config.vocab_size)[0]
    with torch.inference_mode():
        positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
        _run(model, [(input_ids, positions, metadata)])
        positions.copy_(torch.tensor([7, 8, 9, 10, 11, 20, 21, 22]))
        reused = _run(model, [(input_ids, positions, metadata)])[0]
        fresh = _run(model, [(input_ids, positions.clone(), metadata)])[0]
    assert torch.equal(reused, fresh)
