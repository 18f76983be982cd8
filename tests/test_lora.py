"""LoRA adapters (vLLM's enable_lora, LoRARequest) through the whole engine: a request that runs
with an adapter gives transformers' greedy tokens of the model with that adapter merged into its
weights, whatever else shares its steps; bad adapters are refused before anything is queued."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import openai
import pytest
from safetensors.torch import load_file, save_file

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.actors.supervisor import Supervisor
from pagedserve.api.cli import lora_module
from pagedserve.api.client_core import EngineRequestError
from pagedserve.api.preflight import prepare_config
from pagedserve.config import EngineConfig, ServerConfig
from pagedserve.models.lora_format import check_adapter
from pagedserve.models.model_config import load_model_config
from tests.engine_settings import NO_STANDBY
from tests.test_openai_server import free_port
from tests.tiny_models import (
    hf_greedy,
    load_hf_model,
    merge_lora,
    random_prompts,
    save_lora_adapter,
    save_tiny_model,
)

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_model("llama", root / "base")
    return {
        "base": base,
        "a": save_lora_adapter(base, root / "a", seed=1),
        "b": save_lora_adapter(
            base, root / "b", seed=2, rank=8, alpha=4, targets=["q_proj", "v_proj", "down_proj"]
        ),  # fmt: skip
    }


def expected(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    return hf_greedy(model, prompt, NEW_TOKENS)


def check(output, reference: tuple[list[int], list[float]]) -> None:
    completion = output.outputs[0]
    assert completion.token_ids == reference[0]
    got = [next(iter(lp.values())).logprob for lp in completion.logprobs]
    assert got == pytest.approx(reference[1], abs=LOGPROB_ATOL)


@pytest.mark.parametrize(
    "max_loras, layout",
    [(2, {}), (1, {"tensor_parallel_size": 2}), (2, {"pipeline_parallel_size": 2})],
)
def test_each_request_runs_with_its_own_adapter(models, max_loras: int, layout: dict) -> None:
    """One batch mixes two adapters and none, on the same prompts: each request equals its
    merged model (max_loras 1: the adapters take turns in the one slot; here with tp 2: the
    adapters sharded as the weights; pp 2: each stage adapts its own layers). The same prompt
    under another adapter never reuses the first's KV from the prefix cache; every block is
    free afterwards."""
    prompts = random_prompts(400, [40, 7], seed=5)
    lora_a, lora_b = (LoRARequest(name, i, str(models[name])) for i, name in ((1, "a"), (2, "b")))
    references = {
        None: load_hf_model(models["base"]),
        "a": merge_lora(models["base"], models["a"]),
        "b": merge_lora(models["base"], models["b"]),
    }
    with LLM(
        str(models["base"]), enable_lora=True, max_loras=max_loras, max_lora_rank=8,
        num_kv_blocks=64, supervision=NO_STANDBY, skip_tokenizer_init=True, **layout,
    ) as llm:  # fmt: skip
        plain = llm.generate(prompts, GREEDY)
        mixed = llm.generate(
            prompts * 3, GREEDY, lora_request=[lora_a] * 2 + [lora_b] * 2 + [None] * 2
        )
        stats = llm.get_stats()
        assert not llm.supervisor.restarts  # no actor failed on the way
    for prompt, output in zip(prompts, plain):
        check(output, expected(references[None], prompt))
    for i, (name, prompt) in enumerate(zip(["a", "a", "b", "b", None, None], prompts * 3)):
        check(mixed[i], expected(references[name], prompt))
    assert mixed[0].outputs[0].token_ids != plain[0].outputs[0].token_ids
    assert stats.num_free_blocks == stats.num_total_blocks


def test_bad_adapters_are_refused_and_the_engine_keeps_serving(models, tmp_path: Path) -> None:
    wide = save_lora_adapter(models["base"], tmp_path / "wide", seed=3, rank=16)
    broken = tmp_path / "broken"
    shutil.copytree(models["a"], broken)
    tensors = load_file(str(broken / "adapter_model.safetensors"))
    tensors.pop(next(iter(tensors)))
    save_file(tensors, str(broken / "adapter_model.safetensors"))
    unknown = tmp_path / "unknown"
    shutil.copytree(models["a"], unknown)
    config = json.loads((unknown / "adapter_config.json").read_text())
    (unknown / "adapter_config.json").write_text(
        json.dumps({**config, "target_modules": ["q_proj", "lm_head"]})
    )
    prompt = [5, 6, 7]
    cases = {
        "exceeds max_lora_rank": LoRARequest("wide", 3, str(wide)),
        "lacks": LoRARequest("broken", 4, str(broken)),
        "target modules": LoRARequest("unknown", 5, str(unknown)),
        "no readable LoRA adapter": LoRARequest("missing", 6, str(tmp_path / "none")),
        "lora_int_id": LoRARequest("zero", 0, str(models["a"])),
    }
    with LLM(
        str(models["base"]), enable_lora=True, max_lora_rank=8, num_kv_blocks=32,
        supervision=NO_STANDBY,
    ) as llm:  # fmt: skip
        for message, lora in cases.items():
            with pytest.raises(EngineRequestError, match=message):
                llm.generate(prompt, GREEDY, lora_request=lora)
        lora = LoRARequest("a", 1, str(models["a"]))
        served = llm.generate(prompt, GREEDY, lora_request=lora)
        chat = [{"role": "user", "content": "To be"}]
        chatted = llm.chat(chat, GREEDY, lora_request=lora)[0].outputs[0].token_ids
        unadapted = llm.chat(chat, GREEDY)[0].outputs[0].token_ids
        assert not llm.supervisor.restarts
    check(served[0], expected(merge_lora(models["base"], models["a"]), prompt))
    assert chatted != unadapted  # LLM.chat takes the adapter too
    with LLM(
        str(models["base"]), num_kv_blocks=32, supervision=NO_STANDBY, skip_tokenizer_init=True
    ) as plain:
        with pytest.raises(EngineRequestError, match="--enable-lora"):
            plain.generate(prompt, GREEDY, lora_request=LoRARequest("a", 1, str(models["a"])))


def test_an_adapter_is_checked_against_the_models_shapes(models, tmp_path: Path) -> None:
    other = save_tiny_model("llama", tmp_path / "other", hidden_size=32)
    config = load_model_config(str(other))
    with pytest.raises(ValueError, match="lacks"):
        check_adapter(str(models["a"]), config, max_rank=8)
    assert check_adapter(str(models["b"]), load_model_config(str(models["base"])), 8).rank == 8


def test_the_server_serves_adapters_by_model_name(models) -> None:
    """--lora-modules NAME=PATH: a request whose `model` names an adapter runs with it (the
    answer names it too), the served model's name runs without; /v1/models lists both, the
    adapter with the model as its parent; an unknown name is a 404."""
    port = free_port()
    config = EngineConfig(
        model=str(models["base"]), enable_lora=True, num_kv_blocks=64, supervision=NO_STANDBY,
        server=ServerConfig(port=port, served_model_name="tiny",
                            lora_modules={"shakespeare": str(models["a"])}),
    )  # fmt: skip
    prompt = random_prompts(400, [9], seed=6)[0]
    merged = expected(merge_lora(models["base"], models["a"]), prompt)[0]
    plain = expected(load_hf_model(models["base"]), prompt)[0]
    supervisor = Supervisor(config)
    supervisor.start(extra_actors=("api-server",))
    try:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        cards = {card.id: card for card in api.models.list().data}
        assert set(cards) == {"tiny", "shakespeare"}
        assert cards["shakespeare"].model_extra["parent"] == "tiny"
        for name, tokens in (("shakespeare", merged), ("tiny", plain)):
            out = api.completions.create(
                model=name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            assert out.model == name and out.choices[0].model_extra["token_ids"] == tokens
        with pytest.raises(openai.NotFoundError):
            api.completions.create(model="nope", prompt=prompt, max_tokens=2)
    finally:
        supervisor.stop()


def test_lora_flags_and_their_checks_at_start(models) -> None:
    assert lora_module("a=/x/y") == ("a", "/x/y")
    assert lora_module('{"name": "b", "path": "/p", "base_model_name": "m"}') == ("b", "/p")
    for bad in ("a", "=p", '{"name": "b"}'):
        with pytest.raises(argparse.ArgumentTypeError):
            lora_module(bad)
    served = ServerConfig(lora_modules={"a": str(models["a"])})
    with pytest.raises(ValueError, match="needs --enable-lora"):
        prepare_config(EngineConfig(model=str(models["base"]), server=served))
    wide = ServerConfig(lora_modules={"b": str(models["b"])})
    with pytest.raises(ValueError, match="LoRA module 'b'.*max_lora_rank"):
        prepare_config(
            EngineConfig(model=str(models["base"]), enable_lora=True, max_lora_rank=4, server=wide)
        )
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(enable_lora=True, speculative_config=ngram)
