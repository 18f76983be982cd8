"""The worker's host work per speculative verify round, without the model (issue 12).

A ModelRunner on the CPU with a 1-layer, 64-wide Llama (dummy weights) runs speculative steps
of n-gram k=4 with rounds, its requests' tokens periodic so that every lookup proposes. Per
round: the whole round's time, the model's part (DecodeStep.forward, and the CPU-only attention
metadata: on a GPU both are one graph replay), and the rest, the host work a GPU worker does
per round around its replay (staging, uploads, the samples' transfer, acceptance, the lookup).
Medians over --steps steps of each batch size.

    python scripts/profile/verify_rounds.py --batch 1 16 --rounds 4 --steps 60
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
sys.path.insert(0, str(ROOT / "scripts"))

from spec_anatomy import SpecSession, target_dir  # noqa: E402

from pagedserve.actors.worker import startup  # noqa: E402
from pagedserve.actors.worker.cuda_graphs import DecodeStep  # noqa: E402
from pagedserve.actors.worker.model_runner import ModelRunner  # noqa: E402
from pagedserve.config import EngineConfig, SpeculativeConfig  # noqa: E402

CONTEXT = 40  # tokens computed before the first step
TINY = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32}  # fmt: skip


def make_runner(model: Path, batch: int, rounds: int) -> ModelRunner:
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
                             prompt_lookup_max=4, num_rounds=rounds)  # fmt: skip
    blocks = batch * 64
    config = EngineConfig(model=str(model), load_format="dummy", device="cpu",
                          max_model_len=1024, max_num_seqs=batch, num_kv_blocks=blocks,
                          skip_tokenizer_init=True, speculative_config=spec).resolve()  # fmt: skip
    runner = ModelRunner(config)
    runner.load_model()
    startup.init_kv_cache(runner, blocks)
    return runner


class ModelClock:
    """Time inside DecodeStep.forward and .metadata (the model's part of a round)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        for name in ("forward", "metadata"):
            method = getattr(DecodeStep, name)
            setattr(DecodeStep, name, self.timed(method, count=name == "forward"))

    def timed(self, method, count: bool):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            out = method(*args, **kwargs)
            self.seconds += time.perf_counter() - start
            self.calls += count
            return out

        return call


def measure(runner: ModelRunner, clock: ModelClock, batch: int, steps: int) -> dict[str, float]:
    """Median µs per round of the whole round, the model's part and the rest."""
    whole, model, rest = [], [], []
    done = 0
    while done < steps:
        session = SpecSession(runner, batch, CONTEXT, 0, 4)
        for speculate in (False, True, True):  # admit, first proposals
            session.step(speculate)
        for _ in range(min(10, steps - done)):  # within the session's blocks
            clock.seconds, clock.calls = 0.0, 0
            start = time.perf_counter()
            session.step(True)
            elapsed = time.perf_counter() - start
            rounds = max(clock.calls, 1)
            whole.append(elapsed / rounds)
            model.append(clock.seconds / rounds)
            rest.append((elapsed - clock.seconds) / rounds)
            done += 1
        session.close()
    return {k: statistics.median(v) * 1e6 for k, v in
            (("round", whole), ("model", model), ("host", rest))}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    model = target_dir(Path(tempfile.mkdtemp(prefix="verify_rounds_")), TINY)
    clock = ModelClock()
    print("| batch | µs per round | model (forward, metadata) | host, the rest |")
    print("|---:|---:|---:|---:|")
    for batch in args.batch:
        runner = make_runner(model, batch, args.rounds)
        figures = measure(runner, clock, batch, args.steps)
        print(f"| {batch} | {figures['round']:.0f} | {figures['model']:.0f} | "
              f"{figures['host']:.0f} |", flush=True)  # fmt: skip
    shutil.rmtree(model, ignore_errors=True)


if __name__ == "__main__":
    main()
