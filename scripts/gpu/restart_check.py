"""Supervision on the GPU: kill -9 a worker (or a whole tensor-parallel group's rank) or the
scheduler during 20 greedy streams; every stream must end with the tokens of an undisturbed
run, and the table says how long each restart took (the CUDA context, NCCL group and KV cache
of the new worker included).

    python scripts/gpu/restart_check.py [--model DIR] [--tp 1|2] [--out FILE]

Without --model: a dummy-weight Qwen3-0.6B-shaped model (scripts/gpu/configs).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402

from pagedserve import SamplingParams  # noqa: E402
from pagedserve.actors.supervisor import Supervisor  # noqa: E402
from pagedserve.api.client import AsyncClient  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402

PARAMS = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)


async def streams(supervisor: Supervisor, victim: str | None) -> tuple[list[list[int]], float]:
    """20 streams; `victim` is killed once they have produced tokens. The restart's seconds."""
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(16 + 8 * (i % 5))] for i in range(20)]
    results: list[list[int]] = [[] for _ in prompts]
    restart_s = 0.0
    async with AsyncClient(supervisor.addresses.engine_address) as client:

        async def run(index: int) -> None:
            async for delta in client.generate(prompts[index], PARAMS):
                results[index] += delta.token_ids

        async def kill() -> None:
            nonlocal restart_s
            while sum(map(len, results)) < 200:
                await anyio.sleep(0.01)
            name = victim.split("-")[0]  # type: ignore[union-attr]
            before = supervisor.restarts.get(name, 0)
            start = time.monotonic()
            os.kill(supervisor.processes[victim].pid, signal.SIGKILL)  # type: ignore[index]
            while supervisor.restarts.get(name, 0) == before or any(
                a.state != "running" for a in supervisor.status().actors
            ):
                await anyio.sleep(0.05)
            restart_s = time.monotonic() - start

        with anyio.fail_after(600):
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(run, i)
                if victim is not None:
                    tg.start_soon(kill)
    return results, restart_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "scripts/gpu/configs/qwen3-0.6b"))
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    load_format = "dummy" if "configs" in args.model else "auto"
    config = EngineConfig(model=args.model, load_format=load_format,
                          tensor_parallel_size=args.tp, max_model_len=1024)  # fmt: skip
    supervisor = Supervisor(config)
    supervisor.start()
    victims = ["worker", "scheduler"] + (["worker-1"] if args.tp > 1 else [])
    lines = ["| killed | streams identical | restart s |", "|---|:---:|---:|"]
    try:
        expected, _ = anyio.run(streams, supervisor, None)
        for victim in victims:
            got, seconds = anyio.run(streams, supervisor, victim)
            same = sum(a == b for a, b in zip(got, expected))
            lines.append(f"| {victim} | {same}/20 | {seconds:.1f} |")
            print(lines[-1], flush=True)
    finally:
        supervisor.stop()
    text = f"# Restarts on the GPU (tp {args.tp}, {args.model})\n\n" + "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
