"""The command line as a user runs it: the embedded model out of the box, and clean stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx2 as httpx
import psutil
import pytest

from tests.test_openai_server import free_port

PAGEDSERVE = [sys.executable, "-m", "pagedserve.api.cli"]


def test_generate_with_the_embedded_model_writes_english(tmp_path) -> None:
    result = subprocess.run(
        [*PAGEDSERVE, "generate", "ROMEO:", "--max-tokens", "40", "--temperature", "0",
         "--sampling-seed", "0"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    text = result.stdout.split("-" * 40)[0]
    assert text.startswith("ROMEO:")
    words = text.split()
    assert len(words) >= 10
    common = {"the", "and", "i", "to", "of", "a", "my", "you", "that", "is", "not", "me", "in"}
    assert sum(w.lower().strip(",.;:!?'") in common for w in words) >= 3, text
    assert os.listdir(tmp_path) == []  # the run directory and its sockets are gone


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_stops_cleanly_on_ctrl_c_and_sigterm(tmp_path, sig: signal.Signals) -> None:
    port = free_port()
    server = subprocess.Popen(
        [*PAGEDSERVE, "serve", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        # as from a terminal: a shell's background job (a CI runner's) inherits SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": "JULIET:", "max_tokens": 8},
            timeout=60,
        )
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"]
        children = psutil.Process(server.pid).children(recursive=True)
        assert len(children) >= 4  # worker, scheduler, tokenizer, api server
        assert os.listdir(tmp_path)  # the run directory with its ipc sockets
        server.send_signal(sig)
        assert server.wait(timeout=30) in (0, 128 + sig, -sig, 130)
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert alive == []
        assert os.listdir(tmp_path) == []
    finally:
        if server.poll() is None:
            server.kill()


def run_json(args: list[str]) -> object:
    """Run `pagedserve ARGS` and parse the JSON it prints last."""
    import json

    result = subprocess.run([*PAGEDSERVE, *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    start = min(i for i in (result.stdout.find("["), result.stdout.find("{")) if i >= 0)
    return json.loads(result.stdout[start:])


def test_bench_throughput_runs_the_peer_on_the_same_workload() -> None:
    rows = run_json(
        [
            "bench",
            "throughput",
            "--num-prompts",
            "8",
            "--input-len",
            "8",
            "32",
            "--output-len",
            "4",
            "16",
            "--backend",
            "pagedserve",
            "hf",
        ]
    )
    assert [r["backend"] for r in rows] == ["pagedserve", "hf-static(batch=64)"]
    assert rows[0]["output_tokens"] == rows[1]["output_tokens"] > 0


def test_bench_serve_reports_latency_percentiles() -> None:
    result = run_json(
        [
            "bench",
            "serve",
            "--num-prompts",
            "12",
            "--input-len",
            "8",
            "32",
            "--output-len",
            "4",
            "12",
            "--request-rate",
            "30",
        ]
    )
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["total_output_tokens"] >= 12 * 4
    assert 0 < result["ttft"]["median_ms"] <= result["ttft"]["p99_ms"]
    assert result["itl"]["median_ms"] > 0


def test_chat_streams_a_reply_and_ends_on_eof() -> None:
    result = subprocess.run(
        [*PAGEDSERVE, "chat", "--max-tokens", "24", "--sampling-seed", "1"],
        input="What news, my lord?\n", capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    reply = result.stdout.split("bot> ", 1)[1].split("you> ", 1)[0]
    assert len(reply.strip()) > 0
