"""The served output path, end to end: CPU time of each process per output token.

Starts `pagedserve serve` (the embedded model on this CPU unless `--model` says otherwise),
sends `--num-prompts` streamed completions at once with `pagedserve bench serve`'s client (in
this process), and reads the CPU time (user + system) each process spent during the run: every
actor of the server (by its process title, `pagedserve:<label>`) through psutil, and this
client through `resource.getrusage`. CPU time, not wall time: on a shared, loaded machine it
is what each stage costs, whoever else runs. Each figure is divided by the output tokens (and
the client's also by the SSE events it parsed; with coalesced events one carries several
tokens).

    python scripts/profile/serve_path.py --num-prompts 256 --output-len 64
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import subprocess
import sys
import time

import anyio
import httpx
import psutil
from harness import row

from pagedserve.api import bench, bench_serve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not become healthy")


def actor_cpu(server: subprocess.Popen) -> dict[str, float]:
    """CPU seconds of every process under the server, by process title."""
    seconds: dict[str, float] = {}
    for process in psutil.Process(server.pid).children(recursive=True):
        try:
            title = " ".join(process.cmdline()) or process.name()
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        label = title.split()[0].removeprefix("pagedserve:")
        seconds[label] = seconds.get(label, 0.0) + times.user + times.system
    return seconds


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def serve_command(args: argparse.Namespace, port: int) -> list[str]:
    command = [sys.executable, "-m", "pagedserve.api.cli", "serve", "--port", str(port),
               "--max-num-seqs", str(args.max_num_seqs), "--disable-log-requests",
               "--served-model-name", "profiled", "--uvicorn-log-level", "warning"]  # fmt: skip
    if args.model:
        command += ["--model", args.model]
    return command


def measure(args: argparse.Namespace) -> None:
    port = free_port()
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen(serve_command(args, port), env=environment)
    base = f"http://127.0.0.1:{port}"
    lengths = (args.input_len, args.input_len), (args.output_len, args.output_len)
    try:
        wait_healthy(base, server, 300)
        warm = bench.random_workload(8, *lengths, args.vocab, seed=1)
        anyio.run(bench_serve.run, base, "profiled", warm, float("inf"))
        workload = bench.random_workload(args.num_prompts, *lengths, args.vocab, seed=0)
        before, client_before = actor_cpu(server), own_cpu()
        result = anyio.run(bench_serve.run, base, "profiled", workload, float("inf"))
        after, client_after = actor_cpu(server), own_cpu()
    finally:
        server.terminate()
        server.wait(60)
    report(args, result, before, after, client_after - client_before)


def report(
    args: argparse.Namespace, result: dict, before: dict, after: dict, client_s: float
) -> None:
    tokens = max(result["total_output_tokens"], 1)
    events = max(result.get("total_events", 0), 1)  # counted since this script was written
    elapsed, itl = result["duration_s"], result["itl"]
    print(
        f"{result['completed']} completed, {result['failed']} failed, {tokens} tokens in "
        f"{events} events, {elapsed:.1f} s, {result['output_throughput']:.0f} tok/s; "
        f"ITL p50 / p99 {itl['median_ms']:.1f} / {itl['p99_ms']:.1f} ms\n"
    )
    print(row(["process", "CPU s", "busy %", "µs / token", "µs / event"]))
    print(row(["---", "---:", "---:", "---:", "---:"]))
    spent = {label: after[label] - before.get(label, 0.0) for label in sorted(after)}
    for label, seconds in [*spent.items(), ("bench client", client_s)]:
        per_event = f"{1e6 * seconds / events:.1f}" if label == "bench client" else ""
        busy, per_token = 100 * seconds / elapsed, 1e6 * seconds / tokens
        print(row([label, f"{seconds:.2f}", f"{busy:.0f}", f"{per_token:.1f}", per_event]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096, help="prompt ids drawn below this")
    measure(parser.parse_args())


if __name__ == "__main__":
    main()
