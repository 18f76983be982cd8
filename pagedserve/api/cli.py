"""`pagedserve serve | generate | chat` — the command line."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any

from pagedserve.actors.messages import SamplingParams
from pagedserve.api.top import add_top_parser
from pagedserve.config import DEFAULT_MODEL, ServerConfig

DEAD_LINGER_S = 10.0  # a dead engine's server answers 503s this long before it exits

ENGINE_FLAGS: dict[str, tuple[type, str]] = {
    "tokenizer": (str, "tokenizer directory or cached hub id (default: the model's)"),
    "dtype": (str, "weights and activations dtype: auto, float32, bfloat16, float16"),
    "load_format": (str, "auto (safetensors) or dummy (random weights of the real config)"),
    "max_model_len": (int, "longest prompt + output in tokens (default: the model's limit)"),
    "max_num_seqs": (int, "most requests running at once"),
    "max_num_batched_tokens": (int, "token budget of one engine step"),
    "block_size": (int, "tokens per KV-cache block"),
    "num_kv_blocks": (int, "number of KV-cache blocks (default: from memory)"),
    "gpu_memory_utilization": (float, "fraction of GPU memory for weights, activations and KV"),
    "tensor_parallel_size": (int, "number of GPUs to shard the model over"),
    "pipeline_parallel_size": (int, "pipeline stages: the model's layers split over that many"),
    "pipeline_layer_partition": (
        lambda text: [int(n) for n in text.split(",")],  # an int list: "15,17"
        "decoder layers of each pipeline stage, e.g. 15,17 (default: as even as possible)",
    ),
    "distributed_executor_backend": (
        str,
        "where the workers run: mp (processes on this machine) or ray (the nodes of an "
        "existing Ray cluster; pip install 'pagedserve[ray]')",
    ),
    "device": (str, "auto, cpu or cuda"),
    "attention_backend": (str, "auto, torch, triton or cuda"),
    "seed": (int, "engine seed (dummy weights, unseeded sampling)"),
    "speculative_config": (
        json.loads,
        'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
        'or \'{"model": PATH, "num_speculative_tokens": 4}\'',
    ),
    "chat_template": (str, "a Jinja chat template, or the path of a file holding one"),
    "generation_config": (
        str,
        "sampling defaults for fields a request leaves unset: auto (the model's "
        "generation_config.json), vllm (none) or a directory holding one",
    ),
    "quantization": (str, "fp8, gptq, awq, compressed-tensors or int8 (default: the checkpoint's)"),
    "kv_cache_dtype": (str, "auto (the model's dtype) or fp8 (E4M3, per-tensor scales)"),
}
SHORT_FLAGS = {"tensor_parallel_size": ["-tp"], "pipeline_parallel_size": ["-pp"]}
ENGINE_SWITCHES = {  # vLLM's on/off flags; unset leaves the engine's default
    "skip_tokenizer_init": "no tokenizer: token ids in and out",
    "enforce_eager": "no CUDA graphs",
    "trust_remote_code": "accepted for vLLM compatibility; pagedserve runs only its own code",
}
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
]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="HF model directory or cached hub id"
    )
    group = parser.add_argument_group("engine")
    for name, (kind, help_text) in ENGINE_FLAGS.items():
        flags = ["--" + name.replace("_", "-"), *SHORT_FLAGS.get(name, [])]
        group.add_argument(*flags, dest=name, type=kind, default=None, help=help_text)
    for name, help_text in ENGINE_SWITCHES.items():
        group.add_argument(
            "--" + name.replace("_", "-"), action="store_true", default=None, help=help_text
        )
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="automatic prefix caching (on by default)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = [*ENGINE_FLAGS, *ENGINE_SWITCHES, "enable_prefix_caching"]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY`")
    parser.add_argument("--served-model-name", default=None, help="model name in the API")
    parser.add_argument(
        "--disable-log-requests", action="store_true", help="do not log each request (INFO)"
    )
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


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        disable_log_requests=args.disable_log_requests,
        **{name: getattr(args, name) for name in SERVER_FLAGS},
    )


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
    keys = supervisor.credentials_path or "derived from --api-key"
    print(
        f"pagedserve: serving {name} on http://{args.host}:{args.port}/v1 "
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


def cmd_bench(args: argparse.Namespace) -> int:
    from pagedserve.api import bench

    engine_args = {"model": args.model, **engine_kwargs(args)}
    if args.bench == "latency":
        return _bench_latency(args, engine_args)
    if args.bench == "serve":
        return _bench_serve(args, engine_args)
    vocab = _vocab_size(args.model)
    workload = bench.random_workload(
        args.num_prompts, tuple(args.input_len), tuple(args.output_len), vocab, args.workload_seed
    )
    results = []
    for backend in args.backend:
        if backend == "pagedserve":
            results.append(bench.run_pagedserve(workload, engine_args))
            continue
        model = bench.load_hf_model(
            args.model,
            args.load_format or "auto",
            args.dtype or "auto",
            args.device or "cpu",
            args.hf_attn,
        )
        subset = workload[: args.hf_num_prompts or len(workload)]
        if backend == "hf":
            results.append(bench.run_hf_static(subset, model, args.hf_batch_size))
        else:
            results.append(bench.run_hf_continuous(subset, model, args.hf_max_batch_tokens))
    bench.print_json([r.row() for r in results])
    return 0


def _bench_latency(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    from pagedserve.api import bench

    rows = {}
    for backend in args.backend:
        if backend == "pagedserve":
            rows[backend] = bench.latency_pagedserve(
                engine_args, args.input_len[0], args.output_len[0], args.iters
            )
        else:
            model = bench.load_hf_model(
                args.model,
                args.load_format or "auto",
                args.dtype or "auto",
                args.device or "cpu",
                args.hf_attn,
            )
            rows[backend] = bench.latency_hf(
                model, args.input_len[0], args.output_len[0], args.iters
            )
    bench.print_json(rows)
    return 0


def _bench_serve(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    """Against --base-url, or against a server this command starts on a free port."""
    import anyio

    from pagedserve.actors.supervisor import Supervisor
    from pagedserve.api import bench, bench_serve
    from pagedserve.config import EngineConfig, ServerConfig

    workload = bench.random_workload(
        args.num_prompts,
        tuple(args.input_len),
        tuple(args.output_len),
        _vocab_size(args.model),
        args.workload_seed,
    )
    supervisor = None
    base_url = args.base_url
    if base_url is None:
        port = _free_port()
        config = EngineConfig(
            server=ServerConfig(port=port, served_model_name="bench"), **engine_args
        )
        supervisor = Supervisor(config)
        supervisor.start(extra_actors=("api-server",))
        base_url = f"http://127.0.0.1:{port}"
    try:
        model = "bench" if supervisor is not None else args.model
        result = anyio.run(
            bench_serve.run, base_url, model, workload, args.request_rate, args.workload_seed
        )
    finally:
        if supervisor is not None:
            supervisor.stop()
    bench.print_json(result)
    return 0 if result["failed"] == 0 else 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vocab_size(model: str) -> int:
    from pagedserve.config import read_hf_config, resolve_model_path

    return int(read_hf_config(resolve_model_path(model))["vocab_size"])


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="throughput / latency / serve benchmarks (vllm style)")
    bench.add_argument("bench", choices=["throughput", "latency", "serve"])
    bench.add_argument(
        "--backend",
        nargs="+",
        default=["pagedserve"],
        choices=["pagedserve", "hf", "hf-cb"],
        help="engines to run on the same workload, in this order",
    )
    bench.add_argument("--num-prompts", type=int, default=64)
    bench.add_argument(
        "--input-len",
        type=int,
        nargs="+",
        default=[100, 1024],
        help="MIN MAX (uniform) or one fixed length",
    )
    bench.add_argument("--output-len", type=int, nargs="+", default=[100, 1024])
    bench.add_argument("--workload-seed", type=int, default=0)
    bench.add_argument("--iters", type=int, default=3, help="latency: timed repetitions")
    bench.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="serve: Poisson arrival rate in requests/s (inf: all at once)",
    )
    bench.add_argument(
        "--base-url", default=None, help="serve: a running server (default: start one for the run)"
    )
    bench.add_argument("--hf-batch-size", type=int, default=64)
    bench.add_argument("--hf-num-prompts", type=int, default=0, help="hf: first N only")
    bench.add_argument("--hf-max-batch-tokens", type=int, default=8192)
    bench.add_argument("--hf-attn", default=None, help="hf attn_implementation (sdpa, paged...)")
    bench.add_argument(
        "--ignore-eos",
        action="store_true",
        default=True,
        help="always on: every request produces its output length",
    )
    add_engine_args(bench)
    bench.set_defaults(func=cmd_bench)


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
    for name in ("input_len", "output_len"):
        value = getattr(args, name, None)
        if value is not None and len(value) == 1:
            setattr(args, name, [value[0], value[0]])
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
