"""LoRA adapters loaded and unloaded while the server runs (vLLM's POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, here with --allow-runtime-lora-updating): a loaded adapter serves
requests by name exactly as one of --lora-modules does (transformers' greedy tokens of the
merged model), an unloaded one is an unknown model; every mistake is a 4xx and the engine keeps
serving; the adapters survive a restart of the API server, each with its own id."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anyio
import httpx2 as httpx
import msgspec
import openai
import pytest
from safetensors.torch import load_file, save_file

from pagedserve.actors.supervisor import Supervisor
from pagedserve.api.lora_adapters import STATE_FILE, AdapterTable
from pagedserve.api.openai_server import OpenAIServer, build_app
from pagedserve.api.preflight import prepare_config
from pagedserve.config import EngineConfig, ServerConfig
from tests.engine_settings import NO_STANDBY
from tests.test_openai_server import free_port
from tests.test_supervision import wait_for_restart
from tests.tiny_models import hf_greedy, merge_lora, save_lora_adapter, save_tiny_model

MODEL = "tiny"
NEW_TOKENS = 8
PROMPT = [11, 42, 7, 300, 5]
MAX_ADAPTERS = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-runtime")
    base = save_tiny_model("llama", root / "base")
    return {
        "base": base,
        "a": save_lora_adapter(base, root / "a", seed=1),
        "b": save_lora_adapter(base, root / "b", seed=2, rank=8, targets=["q_proj", "down_proj"]),
    }


@pytest.fixture(scope="module")
def server(models):
    """--lora-modules a=..., at most MAX_ADAPTERS adapters, of rank up to 8."""
    port = free_port()
    config = EngineConfig(
        model=str(models["base"]), enable_lora=True, max_lora_rank=8, num_kv_blocks=64,
        supervision=NO_STANDBY,
        server=ServerConfig(
            port=port, served_model_name=MODEL, lora_modules={"a": str(models["a"])},
            allow_runtime_lora_updating=True, max_lora_adapters=MAX_ADAPTERS,
        ),
    )  # fmt: skip
    supervisor = Supervisor(config)
    supervisor.start(extra_actors=("api-server",))
    try:
        yield supervisor, f"http://127.0.0.1:{port}"
    finally:
        supervisor.stop()


@pytest.fixture
def api(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="x", max_retries=0)


def load(base_url: str, body: dict | bytes) -> httpx.Response:
    return post(base_url + "/v1/load_lora_adapter", body)


def unload(base_url: str, body: dict | bytes) -> httpx.Response:
    return post(base_url + "/v1/unload_lora_adapter", body)


def post(url: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url, content=body, headers={"content-type": "application/json"})
    return httpx.post(url, json=body)


def served(api: openai.OpenAI) -> dict[str, str | None]:
    """Each served name, with its parent."""
    return {card.id: card.model_extra["parent"] for card in api.models.list().data}


def greedy_tokens(api: openai.OpenAI, model: str) -> list[int]:
    out = api.completions.create(
        model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert out.model == model
    return out.choices[0].model_extra["token_ids"]


def merged_tokens(models: dict[str, Path], name: str) -> list[int]:
    return hf_greedy(merge_lora(models["base"], models[name]), PROMPT, NEW_TOKENS)[0]


def test_an_adapter_loaded_at_runtime_serves_until_unloaded(server, api, models) -> None:
    base_url = server[1]
    reply = load(base_url, {"lora_name": "b", "lora_path": str(models["b"])})
    assert reply.status_code == 200 and "'b'" in reply.text
    assert served(api) == {MODEL: None, "a": MODEL, "b": MODEL}
    assert greedy_tokens(api, "b") == merged_tokens(models, "b")

    reply = unload(base_url, {"lora_name": "b"})
    assert reply.status_code == 200 and "'b'" in reply.text
    assert served(api) == {MODEL: None, "a": MODEL}
    for model in ("b", "never-loaded"):  # both the unknown model's 404
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            greedy_tokens(api, model)
    assert httpx.get(f"{base_url}/v1/models/b").status_code == 404
    assert unload(base_url, {"lora_name": "b"}).status_code == 404


def test_mistakes_are_4xx_and_the_engine_keeps_serving(server, api, models, tmp_path) -> None:
    supervisor, base_url = server
    bad_adapters = broken_adapters(models, tmp_path)
    for message, path in bad_adapters.items():
        reply = load(base_url, {"lora_name": "bad", "lora_path": str(path)})
        assert reply.status_code == 400 and message in reply.json()["error"]["message"], message
    refused_loads = {
        "already been loaded": {"lora_name": "a", "lora_path": str(models["b"])},
        "served model's name": {"lora_name": MODEL, "lora_path": str(models["b"])},
        "lora_path": {"lora_name": "c"},
        "Expected `str`": {"lora_name": 1, "lora_path": str(models["b"])},
        "length >= 1": {"lora_name": "", "lora_path": str(models["b"])},
        "malformed JSON": b"{",
    }
    for message, body in refused_loads.items():
        reply = load(base_url, body)
        assert reply.status_code == 400 and message in reply.json()["error"]["message"], message
    refused_unloads = {
        400: [{}, {"lora_name": ["a"]}, {"lora_int_id": "1"}],
        404: [{"lora_name": "nope"}, {"lora_int_id": 99}, {"lora_name": "a", "lora_int_id": 99}],
    }
    for status, bodies in refused_unloads.items():
        for body in bodies:
            assert unload(base_url, body).status_code == status, body
    assert served(api) == {MODEL: None, "a": MODEL}
    assert greedy_tokens(api, "a") == merged_tokens(models, "a")
    assert not supervisor.restarts


def broken_adapters(models: dict[str, Path], tmp_path: Path) -> dict[str, Path]:
    """The checker's message -> an adapter directory this server cannot serve."""
    wide = save_lora_adapter(models["base"], tmp_path / "wide", seed=3, rank=16)
    lacking, odd_targets, unknown_targets = (tmp_path / n for n in ("lacking", "odd", "unknown"))
    for path in (lacking, odd_targets, unknown_targets):
        shutil.copytree(models["a"], path)
    tensors = load_file(str(lacking / "adapter_model.safetensors"))
    tensors.pop(next(iter(tensors)))
    save_file(tensors, str(lacking / "adapter_model.safetensors"))
    for path, targets in ((odd_targets, [1, [2]]), (unknown_targets, ["q_proj", "lm_head"])):
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**config, "target_modules": targets}))
    return {
        "exceeds max_lora_rank": wide,
        "lacks": lacking,
        "no list of target_modules": odd_targets,
        "target modules must be among": unknown_targets,
        "no readable LoRA adapter": tmp_path / "none",
    }


async def test_concurrent_loads_of_one_name_and_the_limit(server, api, models) -> None:
    """Two loads of one name at once: one wins, the other finds the name taken; beyond
    max_lora_adapters a load is refused; `load_inplace` replaces an adapter."""
    base_url = server[1]
    body = {"lora_name": "c", "lora_path": str(models["b"])}
    statuses = []
    async with httpx.AsyncClient(base_url=base_url) as http:

        async def load_c() -> None:
            statuses.append((await http.post("/v1/load_lora_adapter", json=body)).status_code)

        async with anyio.create_task_group() as tg:
            tg.start_soon(load_c)
            tg.start_soon(load_c)
    assert sorted(statuses) == [200, 400]
    assert load(base_url, {"lora_name": "d", "lora_path": str(models["b"])}).status_code == 200
    full = load(base_url, {"lora_name": "e", "lora_path": str(models["b"])})
    assert full.status_code == 400 and f"at most {MAX_ADAPTERS}" in full.text
    replaced = load(
        base_url, {"lora_name": "d", "lora_path": str(models["a"]), "load_inplace": True}
    )
    assert replaced.status_code == 200
    assert greedy_tokens(api, "d") == merged_tokens(models, "a")
    for name in ("c", "d"):
        assert unload(base_url, {"lora_name": name}).status_code == 200


def test_loaded_adapters_survive_a_restart_of_the_api_server(server, api, models) -> None:
    """The restarted server serves what its predecessor did (an unloaded module stays
    unloaded), and the next adapter still gets an id none had."""
    supervisor, base_url = server
    assert load(base_url, {"lora_name": "b", "lora_path": str(models["b"])}).status_code == 200
    assert unload(base_url, {"lora_name": "a"}).status_code == 200
    ids_before = lora_ids(supervisor)
    supervisor.processes["api-server"].kill()
    wait_for_restart(supervisor, "api-server", 1)
    assert served(api) == {MODEL: None, "b": MODEL}
    assert greedy_tokens(api, "b") == merged_tokens(models, "b")
    assert load(base_url, {"lora_name": "a", "lora_path": str(models["a"])}).status_code == 200
    new_id = lora_ids(supervisor)["a"]
    assert new_id > max(ids_before.values()) and ids_before["b"] == lora_ids(supervisor)["b"]


def lora_ids(supervisor: Supervisor) -> dict[str, int]:
    """Each served adapter's lora_int_id, from the table the API server keeps."""
    with open(Path(supervisor.run_dir) / STATE_FILE, "rb") as f:
        table = msgspec.json.decode(f.read(), type=AdapterTable)
    return {lora.lora_name: lora.lora_int_id for lora in table.adapters}


@pytest.mark.parametrize(
    "enable_lora, allow, message",
    [(False, False, "--enable-lora"), (True, False, "--allow-runtime-lora-updating")],
)
async def test_the_endpoints_are_off_without_their_flags(
    models, enable_lora: bool, allow: bool, message: str
) -> None:
    served = ServerConfig(allow_runtime_lora_updating=allow)
    config = EngineConfig(model=str(models["base"]), enable_lora=enable_lora, server=served)
    server = OpenAIServer(None, config.resolve(), None, {})  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=build_app(server))
    async with httpx.AsyncClient(transport=transport, base_url="http://server") as http:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            reply = await http.post(path, json={"lora_name": "a", "lora_path": str(models["a"])})
            assert reply.status_code == 400 and message in reply.json()["error"]["message"]


def test_the_flags_are_checked_at_start(models) -> None:
    allowed = ServerConfig(allow_runtime_lora_updating=True)
    with pytest.raises(ValueError, match="--allow-runtime-lora-updating needs --enable-lora"):
        prepare_config(EngineConfig(model=str(models["base"]), server=allowed))
    with pytest.raises(ValueError, match="exceed max_lora_adapters 1"):
        ServerConfig(lora_modules={"a": "/a", "b": "/b"}, max_lora_adapters=1)
