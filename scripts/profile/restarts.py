"""How long a restart takes: kill -9 an actor of a serving engine (the embedded model, the
API server on), then time until the supervisor has it running again and until the next HTTP
completion is served. Two paces: `in-a-row` kills again as soon as the restart is done (the
next standby may still be preparing), `paced` waits --pause-s first (a lone crash).

    python scripts/profile/restarts.py [--actors tokenizer api-server ...] [--kills 10]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import time

import httpx

from pagedserve.actors.supervisor import Supervisor
from pagedserve.config import EngineConfig, ServerConfig, SupervisionConfig

DEADLINE_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def restarted(supervisor: Supervisor, name: str, count: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while supervisor.restarts.get(name, 0) < count or any(
        a.state != "running" for a in supervisor.status().actors
    ):
        if time.monotonic() > deadline or supervisor.dead_reason is not None:
            raise RuntimeError(f"{name} was not restarted: {supervisor.dead_reason}")
        time.sleep(0.01)


def served(base_url: str) -> None:
    body = {"prompt": "To be", "max_tokens": 1, "temperature": 0}
    reply = httpx.post(base_url + "/v1/completions", json=body, timeout=DEADLINE_S)
    reply.raise_for_status()


def kill_and_time(supervisor: Supervisor, base_url: str, name: str) -> tuple[float, float]:
    """Seconds from the kill to running again, and to the next completion served."""
    before = supervisor.restarts.get(name, 0)
    killed = time.monotonic()
    os.kill(supervisor.processes[name].pid, signal.SIGKILL)
    restarted(supervisor, name, before + 1)
    running = time.monotonic() - killed
    served(base_url)
    return running, time.monotonic() - killed


def row(name: str, pace: str, times: list[tuple[float, float]]) -> str:
    running, serving = [t[0] for t in times], [t[1] for t in times]
    figures = [statistics.median(running), max(running), statistics.median(serving), max(serving)]
    return f"| {name} | {pace} | {len(times)} | " + " | ".join(f"{f:.2f}" for f in figures) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--actors", nargs="+", default=["tokenizer", "api-server", "detokenizer"])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--pause-s", type=float, default=8.0)
    args = parser.parse_args()
    port = free_port()
    budget = SupervisionConfig(restart_budget=2 * args.kills + 1)
    config = EngineConfig(num_kv_blocks=512, server=ServerConfig(port=port), supervision=budget)
    supervisor = Supervisor(config)
    supervisor.start(extra_actors=("api-server",))
    base_url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        served(base_url)
        time.sleep(args.pause_s)  # the first standbys are prepared
        for name in args.actors:
            for pace in ("paced", "in-a-row"):
                times = []
                for _ in range(args.kills):
                    times.append(kill_and_time(supervisor, base_url, name))
                    if pace == "paced":
                        time.sleep(args.pause_s)
                rows.append(row(name, pace, times))
                print(rows[-1], flush=True)
    finally:
        supervisor.stop()
    print("\n| actor | pace | kills | to running, median s | max | to served, median s | max |")
    print("|---|---|---:|---:|---:|---:|---:|\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
