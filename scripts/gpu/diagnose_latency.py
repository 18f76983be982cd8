#!/usr/bin/env python3
"""Where a batch-1 decode step's time goes: time per token with CUDA graphs and eagerly, each
actor's loop busy time per token (from the supervisor's status socket), and stack dumps of the
worker and scheduler mid-generation (py-spy, when carried).

    python scripts/gpu/diagnose_latency.py [--model scripts/gpu/configs/qwen3-0.6b]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pagedserve import SamplingParams  # noqa: E402
from pagedserve.actors.supervisor import Supervisor  # noqa: E402
from pagedserve.api.actor_status import StatusClient, render_table  # noqa: E402
from pagedserve.api.client import Client  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402


def dump_stacks(pids: dict[str, int], after_s: float) -> None:
    time.sleep(after_s)
    spy = shutil.which("py-spy") or "/tmp/site/bin/py-spy"
    for label, pid in pids.items():
        done = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True)
        print(f"--- {label} ({pid})\n{done.stdout[:1500]}{done.stderr[-300:]}", flush=True)


def measure(model: str, device: str, eager: bool, tokens: int) -> None:
    config = EngineConfig(
        model=model, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
        device=device, max_num_seqs=8, enforce_eager=eager, log_level="INFO",
    )  # fmt: skip
    supervisor = Supervisor(config)
    supervisor.start()
    address = supervisor.addresses.engine_address
    credentials = supervisor.credentials.for_clients()
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompt = list(range(100, 228))
    try:
        with Client(address, credentials=credentials) as client:
            list(client.generate(prompt, SamplingParams(temperature=0.0, max_tokens=32)))
            status = StatusClient(address, credentials)
            time.sleep(2.5)  # a fresh heartbeat of every actor
            before = status.fetch()
            pids = {k: p.pid for k, p in supervisor.processes.items()
                    if "worker" in k or "scheduler" in k}  # fmt: skip
            spy = threading.Thread(target=dump_stacks, args=(pids, 1.0))
            spy.start()
            start = time.perf_counter()
            stamps = [time.perf_counter() for _ in client.generate(prompt, params)]
            elapsed = time.perf_counter() - start
            spy.join()
            time.sleep(2.5)
            after = status.fetch()
        tpot = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1) * 1e3
        print(f"## eager={eager}: {len(stamps)} chunks, {elapsed:.2f} s, {tpot:.2f} ms/chunk")
        print(render_table(after, before), flush=True)
    finally:
        supervisor.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(ROOT / "scripts/gpu/configs/qwen3-0.6b"))
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    for eager in (False, True):
        measure(args.model, args.device, eager, args.tokens)


if __name__ == "__main__":
    main()
