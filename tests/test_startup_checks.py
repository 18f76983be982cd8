"""What a user meets when starting the engine: settings that cannot work fail at once, in one
clear line, before any process starts; vLLM's flag spellings are understood; and `LLM(...)`
without SamplingParams uses the model's generation config as vLLM does."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import psutil
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.actors.chat import load_tokenizer, resolve_chat_template
from pagedserve.actors.supervisor import Supervisor
from pagedserve.api.cli import build_parser, engine_kwargs, server_config
from pagedserve.api.sampling_defaults import sampling_defaults
from pagedserve.config import EngineConfig, ServerConfig
from tests.engine_settings import NO_STANDBY
from tests.test_openai_server import free_port
from tests.tiny_models import save_tiny_model

PAGEDSERVE = [sys.executable, "-m", "pagedserve.api.cli"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def model_without_tokenizer(tmp_path_factory) -> Path:
    path = save_tiny_model("llama", tmp_path_factory.mktemp("no-tokenizer"))
    for name in TOKENIZER_FILES:
        (path / name).unlink(missing_ok=True)
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PAGEDSERVE, *args], capture_output=True, text=True, timeout=120)


def test_a_model_without_a_tokenizer_fails_before_anything_starts(model_without_tokenizer):
    children = psutil.Process().children(recursive=True)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        LLM(str(model_without_tokenizer))
    assert psutil.Process().children(recursive=True) == children
    result = run_cli("serve", str(model_without_tokenizer), "--port", str(free_port()))
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "--skip-tokenizer-init" in result.stderr


def test_skip_tokenizer_init_serves_token_ids(model_without_tokenizer) -> None:
    port = free_port()
    config = EngineConfig(
        model=str(model_without_tokenizer),
        skip_tokenizer_init=True,
        num_kv_blocks=32,
        server=ServerConfig(port=port),
        supervision=NO_STANDBY,
    )
    supervisor = Supervisor(config)
    supervisor.start(extra_actors=("api-server",))
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "logprobs": 1}
        reply = httpx.post(url, json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        assert httpx.post(url, json={"prompt": "text", "max_tokens": 2}).status_code == 400
    finally:
        supervisor.stop()


def test_a_port_in_use_is_one_line_and_a_nonzero_exit() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        start = time.monotonic()
        result = run_cli("serve", "--port", str(port))
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"pagedserve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    )
    assert result.stdout == "" and time.monotonic() - start < 60


def test_vllm_flag_spellings() -> None:
    args = build_parser().parse_args(
        [
            "serve", "some/model", "-tp", "2", "--enforce-eager", "--enable-prefix-caching",
            "--chat-template", "{{ messages }}", "--uvicorn-log-level", "info",
            "--disable-log-requests", "--trust-remote-code", "--generation-config", "vllm",
            "--max-n", "4", "--tokenizer", "other/tokenizer", "--skip-tokenizer-init",
            "-pp", "2", "--distributed-executor-backend", "ray",
            "--pipeline-layer-partition", "15,17", "--max-waiting-requests", "8",
        ]
    )  # fmt: skip
    assert engine_kwargs(args) == {
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 2,
        "distributed_executor_backend": "ray",
        "pipeline_layer_partition": [15, 17],
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "chat_template": "{{ messages }}",
        "trust_remote_code": True,
        "generation_config": "vllm",
        "tokenizer": "other/tokenizer",
        "skip_tokenizer_init": True,
        "max_waiting_requests": 8,
    }
    server = server_config(args)
    assert (server.uvicorn_log_level, server.disable_log_requests, server.max_n) == (
        "info",
        True,
        4,
    )
    long = build_parser().parse_args(["serve", "--pipeline-parallel-size", "3"])
    assert engine_kwargs(long) == {"pipeline_parallel_size": 3}
    off = build_parser().parse_args(["serve", "--no-enable-prefix-caching"])
    assert engine_kwargs(off) == {"enable_prefix_caching": False}
    assert engine_kwargs(build_parser().parse_args(["serve"])) == {}


def test_chat_templates_come_from_a_file_or_inline(tmp_path) -> None:
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (tmp_path / "template.jinja").write_text(template)
    assert resolve_chat_template(str(tmp_path / "template.jinja")) == template
    assert resolve_chat_template(template) == template
    with pytest.raises(ValueError, match="neither a file"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))
    path = save_tiny_model("llama", tmp_path / "model")
    tokenizer = load_tokenizer(str(path), template)
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == "[hi]"


def test_llm_without_sampling_params_uses_the_generation_config(tmp_path) -> None:
    path = save_tiny_model("llama", tmp_path / "model")
    (path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "top_k": 7, "max_new_tokens": 5, "do_sample": True})
    )
    assert sampling_defaults(EngineConfig(model=str(path), generation_config="vllm")) == {}
    with pytest.raises(ValueError, match="generation_config.json"):
        LLM(str(path), generation_config=str(tmp_path))  # a directory without one
    with LLM(str(path), num_kv_blocks=32, supervision=NO_STANDBY) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 7, 5)
        unset = llm.generate("To be", use_tqdm=False)[0].outputs[0]
        greedy = SamplingParams(temperature=0, max_tokens=5)
        assert unset.token_ids == llm.generate("To be", greedy)[0].outputs[0].token_ids
        assert len(unset.token_ids) == 5 or unset.finish_reason == "stop"
