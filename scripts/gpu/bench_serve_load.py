#!/usr/bin/env python3
"""Serving under load through `pagedserve serve` with a real tokenizer (issue 16's benchmark).

Starts `pagedserve serve` on Qwen3-0.6B shapes (dummy weights) with the tokenizer of
scripts/gpu/make_tokenizer.py (a real byte-level BPE tokenizer at Qwen3's vocabulary size: the
tokenizer and detokenizer actors do their real work), waits for /health, then sends 1,000
streamed requests of 512 input / 256 output tokens at once (`pagedserve bench serve`'s client,
ignore_eos) and prints TTFT / TPOT / ITL percentiles and the output throughput.

    python scripts/gpu/bench_serve_load.py --out FILE [--num-prompts 1000]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import anyio
import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))

from make_tokenizer import build  # noqa: E402

from pagedserve.api import bench, bench_serve  # noqa: E402

QWEN = ROOT / "scripts" / "gpu" / "configs" / "qwen3-0.6b"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, server: subprocess.Popen, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not become healthy")


ADDRESS = re.compile(r"ZeroMQ clients: (\S+), credentials: (\S+)\)")


def echo_and_find_address(server: subprocess.Popen, found: dict[str, str]) -> None:
    """Echo the server's output; remember the engine address and credentials file it prints."""
    assert server.stdout is not None
    for line in server.stdout:
        print(line, end="", flush=True)
        match = ADDRESS.search(line)
        if match:
            found.update(address=match.group(1), credentials=match.group(2))


def watch_actors(found: dict[str, str], server_pid: int, out: Path) -> None:
    """During the load: `pagedserve top` every 2 s (each actor's busy %), then py-spy stacks of
    every engine process: which actor saturates first."""
    if "address" not in found:
        return
    top = [sys.executable, "-m", "pagedserve.api.cli", "top", found["address"], "--credentials",
           found["credentials"], "--interval", "2", "--iterations", "6"]  # fmt: skip
    with out.open("w") as sink:
        subprocess.run(top, stdout=sink, stderr=subprocess.STDOUT, timeout=60, check=False)
        spy = shutil.which("py-spy") or "/tmp/site/bin/py-spy"
        children = subprocess.run(["pgrep", "-P", str(server_pid)], capture_output=True, text=True)
        for pid in [str(server_pid), *children.stdout.split()]:
            dump = subprocess.run([spy, "dump", "--pid", pid], capture_output=True, text=True,
                                  timeout=30, check=False)  # fmt: skip
            sink.write(f"--- py-spy {pid}\n{dump.stdout[:2500]}{dump.stderr[-300:]}\n")


def client_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    args = parser.parse_args()
    model_dir = build(QWEN, Path(tempfile.mkdtemp()) / "qwen3-0.6b-served")
    port = free_port()
    command = [sys.executable, "-m", "pagedserve.api.cli", "serve", str(model_dir), "--port",
               str(port), "--load-format", "dummy", "--max-model-len", "2048",
               "--served-model-name", "qwen3", "--generation-config", "vllm",
               "--max-num-seqs", "256"]  # fmt: skip
    server = subprocess.Popen(
        command,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    found: dict[str, str] = {}
    threading.Thread(target=echo_and_find_address, args=(server, found), daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    try:
        ready_s = wait_healthy(base, server, 300)
        lengths = (args.input_len, args.input_len), (args.output_len, args.output_len)
        warm = bench.random_workload(16, *lengths, 4096, seed=1)
        anyio.run(bench_serve.run, base, "qwen3", warm, float("inf"))
        workload = bench.random_workload(args.num_prompts, *lengths, 4096, seed=0)
        actors_out = Path(args.out).with_suffix(".actors.txt")
        watcher = threading.Thread(target=watch_actors, args=(found, server.pid, actors_out))
        watcher.start()
        cpu_before = client_cpu_s()
        result = anyio.run(bench_serve.run, base, "qwen3", workload, float("inf"))
        client_s = client_cpu_s() - cpu_before
        watcher.join(120)
    finally:
        server.terminate()
        server.wait(60)
    lines = [
        f"## Serving load, {datetime.datetime.now():%Y-%m-%d %H:%M} (issue 16)",
        "",
        f"`pagedserve serve` Qwen3-0.6B shapes (bf16, dummy weights), real BPE tokenizer at "
        f"151,936 tokens; {args.num_prompts} requests of {args.input_len} in / "
        f"{args.output_len} out sent at once, streamed, ignore_eos; server ready in "
        f"{ready_s:.1f} s. The client (this process) used {client_s:.1f} s of CPU in the "
        f"{result['duration_s']:.1f} s run, for {result['total_events']} events (per-actor "
        f"busy %: {actors_out.name}).",
        "",
        "| completed | failed | duration s | output tok/s | req/s | TTFT p50 / p99 ms | "
        "TPOT p50 / p99 ms | ITL p50 / p99 ms |",
        "|---:|---:|---:|---:|---:|---|---|---|",
        f"| {result['completed']} | {result['failed']} | {result['duration_s']:.1f} | "
        f"{result['output_throughput']:.0f} | {result['request_throughput']:.2f} | "
        f"{result['ttft']['median_ms']:.0f} / {result['ttft']['p99_ms']:.0f} | "
        f"{result['tpot']['median_ms']:.1f} / {result['tpot']['p99_ms']:.1f} | "
        f"{result['itl']['median_ms']:.1f} / {result['itl']['p99_ms']:.1f} |",
        "",
        "```json",
        json.dumps(result, indent=1),
        "```",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:8]))


if __name__ == "__main__":
    main()
