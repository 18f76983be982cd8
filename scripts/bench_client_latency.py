"""Per-token latency of the two client paths on the same engine, same run: the ZeroMQ client
(msgspec straight to the tokenizer actor) vs the OpenAI HTTP server (HTTP + SSE + JSON on
top of that same client). Reports inter-token latency (ITL) and time to first token (TTFT),
median and p99, for sequential single streams, so the difference is the path's own overhead.

    python scripts/bench_client_latency.py [--model DIR] [--requests 20] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import openai

from pagedserve import SamplingParams
from pagedserve.actors.supervisor import Supervisor
from pagedserve.api.client import Client
from pagedserve.config import DEFAULT_MODEL, EngineConfig, ServerConfig

RESULTS = Path(__file__).parent / "results" / "client_latency.md"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed_stream(chunks, start: float) -> tuple[float, list[float]]:
    """(ttft, inter-arrival gaps) of an iterator of streamed chunks sent at `start`."""
    stamps = [time.perf_counter() for _ in chunks]
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])]


def run_zmq(address: str, prompts: list[str], params: SamplingParams):
    ttfts, gaps = [], []
    with Client(address) as client:
        for prompt in prompts:
            ttft, g = timed_stream(client.generate(prompt, params), time.perf_counter())
            ttfts.append(ttft)
            gaps += g
    return ttfts, gaps


def run_http(base: str, prompts: list[str], params: SamplingParams):
    client = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
    ttfts, gaps = [], []
    for prompt in prompts:
        start = time.perf_counter()
        stream = client.completions.create(
            model="bench",
            prompt=prompt,
            max_tokens=params.max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        ttft, g = timed_stream(stream, start)
        ttfts.append(ttft)
        gaps += g
    return ttfts, gaps


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def row(name: str, ttfts: list[float], gaps: list[float]) -> str:
    ms = 1000.0
    return (
        f"| {name} | {statistics.median(gaps) * ms:.3f} | {pct(gaps, 0.99) * ms:.3f} | "
        f"{statistics.median(ttfts) * ms:.2f} | {pct(ttfts, 0.99) * ms:.2f} | {len(gaps)} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    port = free_port()
    config = EngineConfig(
        model=args.model, server=ServerConfig(port=port, served_model_name="bench")
    )
    supervisor = Supervisor(config)
    supervisor.start(extra_actors=("api-server",))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [f"ROMEO: speak, number {i}" for i in range(args.requests)]
    try:
        run_zmq(supervisor.addresses.engine_address, prompts[:3], params)  # warm up
        run_http(f"http://127.0.0.1:{port}/v1", prompts[:3], params)
        zmq = run_zmq(supervisor.addresses.engine_address, prompts, params)
        http = run_http(f"http://127.0.0.1:{port}/v1", prompts, params)
    finally:
        supervisor.stop()
    lines = [
        "# Client path latency: ZeroMQ client vs OpenAI HTTP server\n",
        f"- date: {datetime.date.today()}",
        f"- machine: {platform.machine()} CPU ({platform.processor() or 'unknown'}), no GPU",
        f"- model: {args.model}; {args.requests} sequential streams of {args.max_tokens} "
        "tokens each, greedy, EOS ignored; same engine for both paths, same run",
        f"- command: `python scripts/bench_client_latency.py {' '.join(sys.argv[1:])}`\n",
        "| path | ITL median ms | ITL p99 ms | TTFT median ms | TTFT p99 ms | gaps |",
        "|---|---:|---:|---:|---:|---:|",
        row("ZeroMQ client (sync)", *zmq),
        row("HTTP server (openai client, SSE)", *http),
    ]
    overhead = statistics.median(http[1]) - statistics.median(zmq[1])
    lines.append(f"\nHTTP path adds {overhead * 1000:.3f} ms per token at the median.\n")
    text = "\n".join(lines)
    print(text)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
