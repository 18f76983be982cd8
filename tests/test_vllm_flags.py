"""vLLM's `serve` flags that users paste: each parses into the typed config, a value the engine
cannot honour fails at start in one line, and the server follows the rest (CORS closed unless
origins are given, the root path, the response role, prompt token details, usage forced into
every stream, TLS, the request log's prompt cut)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
from pathlib import Path

import httpx2 as httpx
import pytest

from pagedserve.actors.chat import load_tokenizer
from pagedserve.actors.messages import ChatMessage, PromptOptions, SamplingParams
from pagedserve.actors.supervisor import Supervisor
from pagedserve.api.cli import build_parser, engine_kwargs, server_config
from pagedserve.api.generation import plan_jobs
from pagedserve.api.openai_server import OpenAIServer, build_app, logged_prompts
from pagedserve.api.preflight import prepare_config
from pagedserve.api.sampling_defaults import sampling_defaults
from pagedserve.config import EngineConfig, ServerConfig
from tests.engine_settings import NO_STANDBY
from tests.test_openai_server import free_port, running_server
from tests.tiny_models import save_tiny_model

ORIGIN = "https://app.example"
ROOT = "/proxy"
PROMPT = "ROMEO: " + "but soft, what light through yonder window breaks " * 3


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = save_tiny_model("llama", tmp_path_factory.mktemp("vllm-flags"))
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_k": 5}))
    return path


def parse(*flags: str):
    return build_parser().parse_args(["serve", *flags])


def test_vllm_flags_parse_into_the_config() -> None:
    args = parse(
        "--enable-chunked-prefill", "--async-scheduling", "--disable-log-stats",
        "--swap-space", "4", "--runner", "pooling", "--task", "embed",
        "--data-parallel-size", "1", "--tokenizer-mode", "slow",
        "--override-generation-config", '{"temperature": 0.5}',
        "--enable-log-requests", "--max-log-len", "10",
        "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--ssl-ca-certs", "ca.pem",
        "--root-path", ROOT, "--allowed-origins", f'["{ORIGIN}"]',
        "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["Authorization"]',
        "--allow-credentials", "--response-role", "bot", "--return-tokens-as-token-ids",
        "--enable-prompt-tokens-details", "--enable-force-include-usage",
    )  # fmt: skip
    assert engine_kwargs(args) == {
        "tokenizer_mode": "slow",
        "override_generation_config": {"temperature": 0.5},
    }
    assert server_config(args) == ServerConfig(
        disable_log_requests=False,
        max_log_len=10,
        ssl_keyfile="k.pem",
        ssl_certfile="c.pem",
        ssl_ca_certs="ca.pem",
        root_path=ROOT,
        allowed_origins=[ORIGIN],
        allowed_methods=["GET", "POST"],
        allowed_headers=["Authorization"],
        allow_credentials=True,
        response_role="bot",
        return_tokens_as_token_ids=True,
        enable_prompt_tokens_details=True,
        enable_force_include_usage=True,
    )
    assert server_config(parse()) == ServerConfig()  # CORS closed, requests logged


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--disable-log-requests"], True),
        (["--enable-log-requests"], False),
        (["--disable-log-requests", "--enable-log-requests"], False),  # the last one wins
        (["--enable-log-requests", "--disable-log-requests"], True),
    ],
)
def test_log_request_flags_set_one_field(flags: list[str], expected: bool) -> None:
    assert server_config(parse(*flags)).disable_log_requests is expected


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--no-enable-chunked-prefill"], "chunked prefill is always on"),
        (["--data-parallel-size", "2"], "data parallelism is not supported"),
        (["-dp", "4"], "data parallelism is not supported"),
        (["--runner", "transcription"], "--runner 'transcription' is not supported"),
        (["--task", "reward"], "--task 'reward' is not supported"),
        (["--swap-space", "-1"], "--swap-space must be at least 0"),
    ],
)
def test_values_the_engine_cannot_honour_fail_at_start(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine_kwargs(parse(*flags))


def test_unusable_settings_fail_at_start(model_path) -> None:
    with pytest.raises(ValueError, match="tokenizer_mode 'mistral' is not supported"):
        EngineConfig(**engine_kwargs(parse("--tokenizer-mode", "mistral")))
    with pytest.raises(ValueError, match="needs both ssl_keyfile and ssl_certfile"):
        server_config(parse("--ssl-certfile", "c.pem"))
    with pytest.raises(ValueError, match="ssl_ca_certs needs ssl_certfile"):
        server_config(parse("--ssl-ca-certs", "ca.pem"))
    missing = ServerConfig(ssl_certfile="/nonexistent.pem", ssl_keyfile="/nonexistent.key")
    with pytest.raises(ValueError, match="TLS: cannot load"):
        prepare_config(EngineConfig(model=str(model_path), server=missing))
    with pytest.raises(ValueError, match="need allowed_origins"):
        server_config(parse("--allow-credentials"))
    with pytest.raises(SystemExit):  # argparse: not a JSON list of strings
        parse("--allowed-origins", "*")


def test_override_generation_config_merges_over_the_models(model_path) -> None:
    def defaults(**fields) -> dict:
        return sampling_defaults(EngineConfig(model=str(model_path), **fields))

    override = {"temperature": 0.2, "max_new_tokens": 9}
    assert defaults() == {"temperature": 0.7, "top_k": 5}
    assert defaults(override_generation_config=override) == {
        "temperature": 0.2,
        "top_k": 5,
        "max_tokens": 9,
    }
    vllm = defaults(generation_config="vllm", override_generation_config=override)
    assert vllm == {"temperature": 0.2, "max_tokens": 9}
    with pytest.raises(ValueError, match="unknown key"):
        defaults(override_generation_config={"temprature": 0.2})
    with pytest.raises(ValueError, match="temperature must be numbers"):
        defaults(override_generation_config={"temperature": "low"})
    with pytest.raises(ValueError, match="with --override-generation-config"):
        defaults(override_generation_config={"temperature": -1.0})


def test_the_request_log_shows_prompts_only_when_asked_cut_to_max_log_len() -> None:
    sampling = SamplingParams(n=2)
    jobs = plan_jobs(["abcdefgh", [1, 2, 3, 4, 5]], sampling, PromptOptions())
    assert logged_prompts(jobs, 0) == ""  # the default: no user data in the log
    assert logged_prompts(jobs, 3) == ", prompts ['abc', [1, 2, 3]]"
    assert logged_prompts(jobs, 100) == ", prompts ['abcdefgh', [1, 2, 3, 4, 5]]"
    chat = [ChatMessage("system", "be brief"), ChatMessage("user", "hello")]
    chat_jobs = plan_jobs([chat], SamplingParams(), PromptOptions())
    assert logged_prompts(chat_jobs, 12) == ", prompts ['system: be b']"


async def preflight(model_path: Path, server: ServerConfig, origin: str) -> httpx.Response:
    config = EngineConfig(model=str(model_path), server=server).resolve()
    app = build_app(OpenAIServer(None, config, load_tokenizer(str(model_path)), {}))  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://server") as http:
        return await http.options("/v1/chat/completions", headers=cors_headers(origin))


def cors_headers(origin: str) -> dict[str, str]:
    return {"Origin": origin, "Access-Control-Request-Method": "POST"}


async def test_cors_is_closed_by_default_and_open_to_the_allowed_origins(model_path) -> None:
    closed = await preflight(model_path, ServerConfig(), ORIGIN)
    assert "access-control-allow-origin" not in closed.headers
    open_to_one = ServerConfig(allowed_origins=[ORIGIN], api_key="secret")
    allowed = await preflight(model_path, open_to_one, ORIGIN)
    assert allowed.status_code == 200  # no API key needed for a preflight
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    other = await preflight(model_path, open_to_one, "https://evil.example")
    assert "access-control-allow-origin" not in other.headers


@pytest.fixture(scope="module")
def server(model_path: Path):
    port = free_port()
    settings = ServerConfig(
        port=port,
        root_path=ROOT,
        allowed_origins=[ORIGIN],
        response_role="bot",
        enable_prompt_tokens_details=True,
        enable_force_include_usage=True,
        return_tokens_as_token_ids=True,
    )
    config = EngineConfig(
        model=str(model_path),
        max_model_len=128,
        num_kv_blocks=64,
        server=settings,
        supervision=NO_STANDBY,
    )
    with running_server(config) as base:
        yield base


def test_cors_preflight_on_a_running_server(server: str) -> None:
    allowed = httpx.options(f"{server}/v1/completions", headers=cors_headers(ORIGIN))
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    answer = httpx.get(f"{server}/v1/models", headers={"Origin": "https://evil.example"})
    assert answer.status_code == 200
    assert "access-control-allow-origin" not in answer.headers


def test_the_root_path_is_the_prefix_a_proxy_strips(server: str) -> None:
    """uvicorn's (and vLLM's) --root-path: the proxy serves the API under the prefix and
    forwards requests without it; the app's own URLs (scope root_path) carry it."""
    assert httpx.get(f"{server}/v1/models", timeout=10).status_code == 200
    assert httpx.get(f"{server}{ROOT}/v1/models", timeout=10).status_code == 404


def test_chat_messages_take_the_response_role(server: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    reply = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30).json()
    assert reply["choices"][0]["message"]["role"] == "bot"
    chunks = stream(server, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"]["role"] == "bot"


def test_usage_tells_the_cached_prompt_tokens(server: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "logprobs": 1}
    first = httpx.post(f"{server}/v1/completions", json=body, timeout=30).json()
    second = httpx.post(f"{server}/v1/completions", json=body, timeout=30).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 16 <= cached < second["usage"]["prompt_tokens"]  # whole blocks of the prompt
    assert all(t.startswith("token_id:") for t in second["choices"][0]["logprobs"]["tokens"])


def test_every_stream_ends_with_usage(server: str) -> None:
    chunks = stream(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 3})
    assert chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 3
    assert "usage" not in chunks[0]  # the other chunks carry none (no continuous stats)


def stream(server: str, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{server}{path}", json=body | {"stream": True}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    ip = x509.IPAddress(ipaddress.ip_address("127.0.0.1"))
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([ip]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_tls_serves_https_with_the_certificate(tmp_path, model_path) -> None:
    cert, key = self_signed_certificate(tmp_path)
    port = free_port()
    settings = ServerConfig(port=port, ssl_certfile=str(cert), ssl_keyfile=str(key))
    config = prepare_config(
        EngineConfig(
            model=str(model_path),
            max_model_len=64,
            num_kv_blocks=16,
            server=settings,
            supervision=NO_STANDBY,
            skip_tokenizer_init=True,  # the test asks for /version only: no tokenizer to load
        )
    )
    supervisor = Supervisor(config)
    supervisor.start(extra_actors=("api-server",))
    try:
        trusted = ssl.create_default_context(cafile=str(cert))
        answer = httpx.get(f"https://127.0.0.1:{port}/version", verify=trusted, timeout=10)
        assert answer.status_code == 200
        with pytest.raises(httpx.TransportError):  # plain http on the TLS port
            httpx.get(f"http://127.0.0.1:{port}/version", timeout=10)
    finally:
        supervisor.stop()
