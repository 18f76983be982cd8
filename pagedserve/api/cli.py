"""`pagedserve serve | generate | chat` — the command line."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

from pagedserve.actors.messages import SamplingParams
from pagedserve.api.bench_cli import add_bench_parser
from pagedserve.api.engine_args import add_engine_args, engine_kwargs
from pagedserve.api.top import add_top_parser
from pagedserve.config import REASONING_PARSERS, TOOL_CALL_PARSERS, ServerConfig

DEAD_LINGER_S = 10.0  # a dead engine's server answers 503s this long before it exits

# ServerConfig fields that `pagedserve serve` takes as flags (the request limits and the like)
SERVER_FLAGS = [
    "uvicorn_log_level",
    "health_check_timeout_s",
    "max_request_body_bytes",
    "max_json_depth",
    "max_prompt_chars",
    "max_prompts_per_request",
    "max_n",
    "max_stop_strings",
    "max_stop_string_chars",
    "max_stop_token_ids",
    "max_bad_words",
    "max_lora_adapters",
]
# vLLM's HTTP and response flags: ServerConfig fields of the same names (add_vllm_server_args)
VLLM_SERVER_FLAGS = [
    "max_log_len",
    "ssl_keyfile",
    "ssl_certfile",
    "ssl_ca_certs",
    "root_path",
    "allowed_origins",
    "allowed_methods",
    "allowed_headers",
    "allow_credentials",
    "response_role",
    "return_tokens_as_token_ids",
    "enable_prompt_tokens_details",
    "enable_force_include_usage",
]


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY`")
    parser.add_argument("--served-model-name", default=None, help="model name in the API")
    parser.add_argument(
        "--disable-log-requests", action="store_true", default=False,
        help="do not log each request (INFO)",
    )  # fmt: skip
    parser.add_argument(
        "--enable-log-requests", action="store_false", dest="disable_log_requests",
        default=False, help="log each request at INFO (the default; vLLM's spelling)",
    )  # fmt: skip
    parser.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help='tool_choice "auto": calls found in the reply by --tool-call-parser',
    )  # fmt: skip
    parser.add_argument(
        "--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
        help="the model's tool-call format (hermes: Hermes, Qwen2.5, Qwen3; llama3_json: "
        "Llama 3.1-3.3; openai: GPT-OSS's harmony messages to functions.NAME)",
    )  # fmt: skip
    parser.add_argument(
        "--reasoning-parser", choices=REASONING_PARSERS, default=None,
        help="a chat reply's thinking as the message's reasoning_content (deepseek_r1: "
        "<think>...</think>, the reply starts in thinking; qwen3: both tags in the reply; "
        "openai_gptoss: GPT-OSS's harmony analysis channel)",
    )  # fmt: skip
    parser.add_argument(
        "--lora-modules", nargs="+", type=lora_module, default=[], metavar="NAME=PATH",
        help="LoRA adapters served by name (a request's model), with --enable-lora; also "
        'vLLM\'s JSON form \'{"name": NAME, "path": PATH}\'',
    )  # fmt: skip
    parser.add_argument(
        "--allow-runtime-lora-updating", action="store_true",
        help="with --enable-lora: POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
        "(any client that reaches the server may then load adapters from its file system)",
    )  # fmt: skip
    add_vllm_server_args(parser)
    group = parser.add_argument_group("server settings and request limits")
    defaults = ServerConfig()
    for name in SERVER_FLAGS:
        default = getattr(defaults, name)
        group.add_argument(
            "--" + name.replace("_", "-"),
            type=type(default),
            default=default,
            help=f"default {default}",
        )


def add_vllm_server_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags of the HTTP server and its answers (ServerConfig fields)."""
    group = parser.add_argument_group("HTTP and responses (vLLM's flags)")
    group.add_argument(
        "--max-log-len", type=int, default=0,
        help="the request log shows each prompt cut to this many characters (or token ids); "
        "0 (the default): no prompt text in the log",
    )  # fmt: skip
    group.add_argument("--ssl-keyfile", default=None, help="TLS: the certificate's private key")
    group.add_argument("--ssl-certfile", default=None, help="TLS: the server's certificate")
    group.add_argument("--ssl-ca-certs", default=None, help="TLS: CA certificates (uvicorn's)")
    group.add_argument(
        "--root-path", default="", help="the path prefix of a proxy in front of the server"
    )
    group.add_argument(
        "--allowed-origins", type=json_list, default=None, metavar="JSON",
        help='CORS: origins allowed to read answers, e.g. \'["https://app.example"]\' '
        "(default: no CORS headers at all, unlike vLLM's allow-all)",
    )  # fmt: skip
    group.add_argument(
        "--allowed-methods", type=json_list, default=["*"], metavar="JSON",
        help='CORS, with --allowed-origins: methods allowed (default ["*"])',
    )  # fmt: skip
    group.add_argument(
        "--allowed-headers", type=json_list, default=["*"], metavar="JSON",
        help='CORS, with --allowed-origins: request headers allowed (default ["*"])',
    )  # fmt: skip
    group.add_argument(
        "--allow-credentials", action="store_true",
        help="CORS, with --allowed-origins: allow cookies and Authorization headers",
    )  # fmt: skip
    group.add_argument(
        "--response-role", default="assistant", help="the role of chat completion messages"
    )
    group.add_argument(
        "--return-tokens-as-token-ids", action="store_true",
        help='logprobs name tokens "token_id:{id}" in every answer (also a request field)',
    )  # fmt: skip
    group.add_argument(
        "--enable-prompt-tokens-details", action="store_true",
        help="usage.prompt_tokens_details.cached_tokens: prompt tokens the prefix cache served",
    )  # fmt: skip
    group.add_argument(
        "--enable-force-include-usage", action="store_true",
        help="usage at the end of every stream, as with stream_options.include_usage",
    )  # fmt: skip


def json_list(text: str) -> list[str]:
    """A JSON list of strings (vLLM's --allowed-origins and the like)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
    return value


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        disable_log_requests=args.disable_log_requests,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        lora_modules=dict(args.lora_modules),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        **{name: getattr(args, name) for name in [*SERVER_FLAGS, *VLLM_SERVER_FLAGS]},
    )


def lora_module(text: str) -> tuple[str, str]:
    """--lora-modules' NAME=PATH, or vLLM's JSON object with name and path."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
            return str(spec["name"]), str(spec["path"])
        except (ValueError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(f"not a LoRA module: {text!r}") from None
    name, sep, path = text.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(f"a LoRA module is NAME=PATH, got {text!r}")
    return name, path


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--temperature", type=float, default=0.8)
    group.add_argument("--top-p", type=float, default=0.95)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def sampling_from(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        stop=args.stop,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedserve.api.llm import LLM

    try:
        llm = LLM(args.model, **engine_kwargs(args))
    except ValueError as exc:  # a setting that cannot work, found before anything started
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 1
    with llm:
        outputs = llm.generate(args.prompts, sampling_from(args))
    for prompt, output in zip(args.prompts, outputs):
        print(prompt + output.outputs[0].text)
        print("-" * 40)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedserve.actors.supervisor import EngineDeadError, Supervisor
    from pagedserve.api.preflight import check_port_free, prepare_config
    from pagedserve.config import EngineConfig

    try:
        config = EngineConfig(
            model=args.model_arg or args.model, server=server_config(args), **engine_kwargs(args)
        )
        config = prepare_config(config)
        check_port_free(args.host, args.port)
        supervisor = Supervisor(config)
    except ValueError as exc:
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 1
    try:
        supervisor.start(extra_actors=("api-server",))
    except EngineDeadError as exc:
        print(f"pagedserve: error: the engine did not start: {exc}", file=sys.stderr)
        return 1
    name = args.served_model_name or config.model
    scheme = "https" if args.ssl_certfile else "http"
    keys = supervisor.credentials_path or "derived from --api-key"
    print(
        f"pagedserve: serving {name} on {scheme}://{args.host}:{args.port}/v1 "
        f"(ZeroMQ clients: {supervisor.addresses.engine_address}, credentials: {keys})",
        flush=True,
    )
    try:
        while supervisor.dead_reason is None:
            time.sleep(0.5)
        print(f"pagedserve: engine died: {supervisor.dead_reason}", file=sys.stderr)
        time.sleep(DEAD_LINGER_S)  # /health answers 503 meanwhile
        return 1
    finally:
        supervisor.stop()


def cmd_chat(args: argparse.Namespace) -> int:
    from pagedserve.actors.messages import ChatMessage
    from pagedserve.actors.supervisor import Supervisor
    from pagedserve.api.client import Client
    from pagedserve.api.preflight import prepare_config
    from pagedserve.config import EngineConfig

    try:
        supervisor = Supervisor(
            prepare_config(EngineConfig(model=args.model, **engine_kwargs(args)))
        )
    except ValueError as exc:
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 1
    supervisor.start()
    history: list[ChatMessage] = []
    try:
        credentials = supervisor.credentials.for_clients()
        with Client(supervisor.addresses.engine_address, credentials=credentials) as client:
            while True:
                try:
                    line = input("you> ")
                except EOFError:
                    return 0
                history.append(ChatMessage("user", line))
                print("bot> ", end="", flush=True)
                reply = ""
                for delta in client.generate(list(history), sampling_from(args)):
                    reply += delta.text
                    print(delta.text, end="", flush=True)
                print()
                history.append(ChatMessage("assistant", reply))
    finally:
        supervisor.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description="A small, fast LLM inference and serving engine. With no model given, "
        "commands use the embedded tiny Shakespeare model on the CPU.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts, offline")
    gen.add_argument("prompts", nargs="+", help="prompt text(s)")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (and ZeroMQ endpoint)")
    serve.add_argument("model_arg", nargs="?", metavar="MODEL", help="model (default: embedded)")
    add_server_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    chat = sub.add_parser("chat", help="interactive streaming chat in the terminal")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)
    add_bench_parser(sub)
    add_top_parser(sub)
    return parser


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds `with LLM(...)`, which stops every actor


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
