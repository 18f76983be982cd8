#!/usr/bin/env python3
"""The prefill graphs (issue 15, actors/worker/prefill_graphs.py) on a GPU: first, each prompt
length's first token by the prefill graph against the eager prefill path (dummy bf16 weights:
a mismatch is reported with both tokens); then batch-1 time to first token in the ModelRunner
(`runner.launch` + finish, as prefill_anatomy.py) by the prefill graphs, by decode-graph rows
(static prefill) and eagerly, and the capture's time and graph count.

    python scripts/gpu/check_prefill_graphs.py [--models DIR ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts/gpu"))

from prefill_anatomy import PrefillSession, timed  # noqa: E402

from pagedserve.actors.worker import startup  # noqa: E402
from pagedserve.actors.worker.model_runner import ModelRunner  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402

LENGTHS = (2, 7, 16, 17, 100, 128, 200)


def set_path(runner: ModelRunner, path: str, saved: tuple) -> None:
    prefill_step, static = saved
    runner.prefill_step = prefill_step if path == "prefill graphs" else None
    runner.static_prefill = static and path != "eager"


def first_token(runner: ModelRunner, length: int) -> int:
    result = runner.execute(PrefillSession(length, runner.block_size).plan())
    runner.input_batch.remove_request(result.handles[0])
    return result.sampled_token_ids[0]


def check_model(model: str, lines: list[str]) -> None:
    config = EngineConfig(model=model, load_format="dummy", device="cuda", max_model_len=4096,
                          num_kv_blocks=256, skip_tokenizer_init=True).resolve()  # fmt: skip
    runner = ModelRunner(config)
    runner.load_model()
    startup.init_kv_cache(runner, 256)
    saved = (runner.prefill_step, runner.static_prefill)
    step = runner.prefill_step
    name = Path(model).name
    count, sizes = (len(step.graphs), step.sizes) if step else (0, "-")
    lines += [f"## {name}", "",
              f"- prefill graphs: {count} ({sizes}),"
              f" capture {runner.setup_seconds.get('prefill_graphs')} s; decode graphs + prefill"
              f" graphs {runner.setup_seconds.get('cuda_graphs')} s", ""]  # fmt: skip
    if step is None:
        lines.append("- NO PREFILL GRAPHS (capture failed or off): see the log")
        return
    lines += ["| prompt | prefill graph token | eager token | same |", "|---:|---:|---:|---|"]
    for length in LENGTHS:
        tokens = []
        for path in ("prefill graphs", "eager"):
            set_path(runner, path, saved)
            tokens.append(first_token(runner, length))
        lines.append(f"| {length} | {tokens[0]} | {tokens[1]} | {tokens[0] == tokens[1]} |")
    lines += ["", "| prompt | path | launch host ms | TTFT ms |", "|---:|---|---:|---:|"]
    for length in (16, 128, 256):
        for path in ("prefill graphs", "decode-graph rows", "eager"):
            try:
                set_path(runner, path, saved)
                session = PrefillSession(length, runner.block_size)
                timed(runner, session, 3)
                launch, ttft = timed(runner, session, 30)
                assert session.previous is not None  # the last request stays until dropped
                runner.input_batch.remove_request(session.previous)
                lines.append(f"| {length} | {path} | {launch:.3f} | {ttft:.3f} |")
            except Exception:
                runner.finish()
                for handle in list(runner.input_batch.row_of):
                    runner.input_batch.remove_request(handle)
                lines.append(f"| {length} | {path} | FAILED: {traceback.format_exc(limit=2)!r} | |")
    lines.append("")


def main() -> None:
    parser = argparse.ArgumentParser()
    configs = ROOT / "scripts/gpu/configs"
    parser.add_argument(
        "--models", nargs="+", default=[str(configs / "qwen3-0.6b"), str(configs / "llama-3.1-8b")]
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lines = ["# Prefill graphs (issue 15): parity and batch-1 TTFT in the ModelRunner", ""]
    for model in args.models:
        try:
            check_model(model, lines)
        except Exception:
            lines += [f"## {Path(model).name}: FAILED", "```", traceback.format_exc(), "```"]
        print("\n".join(lines), flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
