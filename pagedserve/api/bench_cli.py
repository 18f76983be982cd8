"""`pagedserve bench throughput | latency | serve` — vLLM-style benchmarks from the command line."""

from __future__ import annotations

import argparse
from typing import Any

from pagedserve.api.engine_args import add_engine_args, engine_kwargs


def cmd_bench(args: argparse.Namespace) -> int:
    from pagedserve.api import bench

    for name in ("input_len", "output_len"):  # one length: a fixed length
        value = getattr(args, name)
        if len(value) == 1:
            setattr(args, name, [value[0], value[0]])
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
        model = _hf_model(args)
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
            model = _hf_model(args)
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


def _hf_model(args: argparse.Namespace) -> Any:
    from pagedserve.api import bench

    return bench.load_hf_model(
        args.model, args.load_format or "auto", args.dtype or "auto", args.device or "cpu",
        args.hf_attn,
    )  # fmt: skip


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
