"""Sliding-window attention and logit softcaps against transformers, float32 on the CPU,
through the engine: Gemma 2 (a window on every other layer, attention and final logit
softcaps), Gemma 3 (q / k norms, its sliding layers' own RoPE base, linear RoPE scaling on the
others) and Mistral v0.1's window on every layer, spanning blocks. Prompts run past the
window, in chunks (chunked prefill), and again from the prefix cache; every attention backend
of the CPU (the head-major "torch" one and the "torch_ref" reference the Triton kernels are
checked against)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.models.model_config import (
    load_model_config,
    sliding_windows,
    uses_windowed_attention,
)
from tests.engine_settings import NO_STANDBY
from tests.tiny_models import hf_greedy, load_hf_model, random_prompts, save_tiny_model

NEW_TOKENS = 16
LOGPROB_ATOL = 1e-3
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
PROMPT_LENGTHS = [3, 17, 40, 90]  # within, past and far past the windows
MISTRAL_WINDOW = 24  # a block and a half


def save_mistral(path: Path) -> Path:
    save_tiny_model("llama", path)
    config = json.loads((path / "config.json").read_text())
    config.update(
        architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=MISTRAL_WINDOW
    )
    (path / "config.json").write_text(json.dumps(config))
    return path


@dataclass
class WindowedModel:
    """A saved tiny model and transformers' copy, with its greedy results kept."""

    path: Path
    hf_model: transformers.PreTrainedModel
    results: dict[tuple[int, ...], tuple[list[int], list[float]]] = field(default_factory=dict)

    def greedy(self, prompt: list[int]) -> tuple[list[int], list[float]]:
        key = tuple(prompt)
        if key not in self.results:
            self.results[key] = hf_greedy(self.hf_model, prompt, NEW_TOKENS)
        return self.results[key]


@pytest.fixture(scope="module")
def windowed_models(tmp_path_factory) -> dict[str, WindowedModel]:
    """Each arch's model, saved on first use."""

    class Models(dict):
        def __missing__(self, arch: str) -> WindowedModel:
            path = tmp_path_factory.mktemp(arch) / "model"
            if arch == "mistral":
                save_mistral(path)
            else:
                save_tiny_model(arch, path)
            self[arch] = WindowedModel(path, load_hf_model(path))
            return self[arch]

    return Models()


@pytest.mark.parametrize(
    "arch, backend",
    [("gemma2", "torch"), ("gemma2", "torch_ref"), ("gemma3", "torch"), ("gemma3", "torch_ref"),
     ("mistral", "torch")],
)  # fmt: skip
def test_greedy_tokens_and_logprobs_match_transformers_past_the_window(
    windowed_models: dict[str, WindowedModel], arch: str, backend: str
) -> None:
    windowed_model = windowed_models[arch]
    path = windowed_model.path
    prompts = random_prompts(400, PROMPT_LENGTHS, seed=1)
    with LLM(
        str(path), attention_backend=backend, max_num_batched_tokens=32, num_kv_blocks=128,
        supervision=NO_STANDBY, skip_tokenizer_init=True,
    ) as llm:  # fmt: skip
        outputs = llm.generate(prompts, GREEDY)
        cached = llm.generate(prompts[-1:], GREEDY)[0]
        stats = llm.get_stats()
    for prompt, output in zip(prompts, outputs):
        tokens, logprobs = windowed_model.greedy(prompt)
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        got = [next(iter(lp.values())).logprob for lp in completion.logprobs]
        assert got == pytest.approx(logprobs, abs=LOGPROB_ATOL)
    assert cached.num_cached_tokens >= 64  # the 90-token prompt's full blocks, from the cache
    assert cached.outputs[0].token_ids == outputs[-1].outputs[0].token_ids
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_gemma_2_over_two_workers_keeps_transformers_tokens(
    windowed_models: dict[str, WindowedModel], layout: dict[str, int]
) -> None:
    """Two tensor-parallel ranks (one kv head each) or two pipeline stages (a layer each: the
    first stage embeds, the last norms and caps the logits)."""
    windowed_model = windowed_models["gemma2"]
    prompts = random_prompts(400, PROMPT_LENGTHS[1:3], seed=1)
    with LLM(
        str(windowed_model.path), num_kv_blocks=64, supervision=NO_STANDBY,
        skip_tokenizer_init=True, **layout,
    ) as llm:  # fmt: skip
        outputs = llm.generate(prompts, GREEDY)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == windowed_model.greedy(prompt)[0]


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "mistral"])
def test_the_windows_and_softcaps_change_these_models(
    windowed_models: dict[str, WindowedModel], arch: str
) -> None:
    """The parity above checks the options: transformers' model without its window (and for
    Gemma 2 without its softcaps) answers the long prompt otherwise."""
    windowed_model = windowed_models[arch]
    hf_model = windowed_model.hf_model
    prompt = random_prompts(400, PROMPT_LENGTHS, seed=1)[-1]
    tokens, logprobs = windowed_model.greedy(prompt)
    for change in ({"sliding_window": 4096}, {"attn_logit_softcapping": None},
                   {"final_logit_softcapping": None}):  # fmt: skip
        if getattr(hf_model.config, next(iter(change)), None) is None:
            continue
        config = hf_model.config.to_dict() | change
        config.pop("layer_types", None)  # rebuilt from the window's pattern
        changed = type(hf_model)(type(hf_model.config).from_dict(config)).eval()
        changed.load_state_dict(hf_model.state_dict())
        other_tokens, other_logprobs = hf_greedy(changed, prompt, NEW_TOKENS)
        differs = (
            other_tokens != tokens
            or max(abs(a - b) for a, b in zip(other_logprobs, logprobs)) > 10 * LOGPROB_ATOL
        )
        assert differs, change


def test_disable_sliding_window_caps_the_context_to_the_window(tmp_path: Path) -> None:
    """vLLM's --disable-sliding-window: full attention, the context capped to the window
    (where full attention is the model's own); a longer prompt is refused."""
    from pagedserve.api.client_core import EngineRequestError

    path = save_mistral(tmp_path / "model")
    prompts = random_prompts(400, [3, 16], seed=5)  # with 8 tokens out: within the window
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    with LLM(
        str(path), supervision=NO_STANDBY, skip_tokenizer_init=True, disable_sliding_window=True
    ) as llm:
        assert llm.supervisor.sized_config.max_model_len == MISTRAL_WINDOW
        outputs = llm.generate(prompts, params)
        with pytest.raises(EngineRequestError, match=f"maximum context length is {MISTRAL_WINDOW}"):
            llm.generate(random_prompts(400, [30], seed=6), params)
    hf_model = load_hf_model(path)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 8)[0]


@pytest.mark.parametrize(
    "values, windows",
    [
        ({"sliding_window": 4096}, [4096] * 3),  # Mistral v0.1
        ({"sliding_window": None}, [0] * 3),  # Mistral v0.2 on
        ({"model_type": "qwen2", "sliding_window": 32768, "use_sliding_window": False}, [0] * 3),
        (
            {
                "model_type": "qwen2",
                "sliding_window": 16,
                "use_sliding_window": True,
                "max_window_layers": 1,
            },
            [0, 16, 16],
        ),  # fmt: skip
        (
            {"sliding_window": 16, "layer_types": ["full_attention", "sliding_attention"] * 2},
            [0, 16, 0, 16],
        ),  # fmt: skip
        ({"model_type": "gemma2", "sliding_window": 8}, [8, 0, 8]),
        (
            {"model_type": "gemma3_text", "sliding_window": 8, "sliding_window_pattern": 3},
            [8, 8, 0],
        ),  # fmt: skip
        ({}, [0] * 3),  # Llama
    ],
)
def test_each_layers_window_as_transformers_assigns_it(values: dict, windows: list[int]) -> None:
    values = {"num_hidden_layers": len(windows)} | values
    assert sliding_windows(values) == windows
    assert uses_windowed_attention(values, disable_sliding_window=False) == any(windows)
    assert not uses_windowed_attention(values, disable_sliding_window=True)


def test_an_explicit_null_turns_a_window_or_softcap_off(tmp_path: Path) -> None:
    """Mistral v0.2 on writes "sliding_window": null (MistralConfig's default is 4096); a
    Gemma 2 config may set a softcap to null (transformers' defaults are 50 and 30)."""
    for values, field_name in (
        ({"model_type": "mistral", "sliding_window": None}, "sliding_window"),
        ({"model_type": "gemma2", "attn_logit_softcapping": None}, "attn_logit_softcapping"),
        ({"model_type": "gemma2", "final_logit_softcapping": None}, "final_logit_softcapping"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2} | values))
        config = load_model_config(str(tmp_path))
        assert getattr(config, field_name) is None
    assert sliding_windows(load_model_config(str(tmp_path)).to_dict()) == [4096, 0]  # gemma2's
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "model_type": "mistral"})
    )
    assert sliding_windows(load_model_config(str(tmp_path)).to_dict()) == [4096, 4096]


def test_a_softcap_needs_a_windowed_backend_even_without_windows() -> None:
    """The CUDA decode kernel takes neither option: a model with either gets Triton's."""
    from pagedserve.kernels.attention_backends import resolve_attention_backend

    assert uses_windowed_attention({"attn_logit_softcapping": 50.0}, disable_sliding_window=True)
    assert not resolve_attention_backend("cuda", windowed=True).name == "cuda"
