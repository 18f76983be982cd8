#!/usr/bin/env python3
"""Programmatic dependent launch in the engine (EngineConfig.dependent_launch): what it changes
in the outputs (nothing, it must not) and what it buys at batch 1 (W3).

For each variant (Qwen3-0.6B bf16; Llama-3.1-8B bf16, fp8 weights, int4 GPTQ g128; dummy
weights, the same seed), engines with dependent_launch off and on, in turn, --rounds times.
Per engine:
  outputs  greedy, ignore_eos: 4 random 128-token prompts, 64 tokens each, and two of them
           with logprobs=1 (the sampler's path), each request alone; every token id and
           logprob must equal those of the variant's first `off` engine;
  W3       batch 1, 128-token prompt, 256 output tokens, streamed through the ZeroMQ client:
           time per output token, median of --iters prompts after a warm-up one
           (bench.latency_of_client, as bench_workloads / bench_quant measure W3).
Prints the table last: ms per token off / on (mean of the rounds), the speed-up, outputs equal.
--workloads W1 W2: also the throughput workloads of bench_workloads.py (vLLM's offline settings),
one engine off and one on each, output tok/s and req/s. --ttft qwen3 llama: also the offline
batch-1 time to first token of a 128-token prompt (bench_first_token.py's measure), off and on.

    python3 scripts/gpu/bench_dependent_launch.py [--only qwen3 llama fp8 int4] [--rounds 1]
        [--workloads W1 W2] [--ttft qwen3 llama]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_first_token import offline_ttft  # noqa: E402
from bench_quant import gptq_config_dir  # noqa: E402
from bench_workloads import LLAMA, QWEN, WORKLOADS, engine_args, free_gpu  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.api import bench  # noqa: E402
from pagedserve.config import read_hf_config  # noqa: E402


def variants(root: Path) -> dict[str, tuple[str, dict]]:
    return {
        "qwen3": (QWEN, {}),
        "llama": (LLAMA, {}),
        "fp8": (LLAMA, {"quantization": "fp8"}),
        "int4": (gptq_config_dir(root), {}),
    }


def outputs_of(llm: LLM) -> list[tuple]:
    """(token ids, logprobs) of every request of the outputs check, each request alone: a
    batch's composition depends on when its requests reach the scheduler, and its GEMMs'
    rounding on the composition, so only lone requests are the same run to run
    (check_dependent_launch.py compares batches at the kernels)."""
    prompts = [{"prompt_token_ids": p} for p, _ in
               bench.random_workload(4, (128, 128), (1, 1), 1000, seed=7)]  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1)
    results = [llm.generate(p, greedy, use_tqdm=False)[0] for p in prompts]
    results += [llm.generate(p, with_logprobs, use_tqdm=False)[0] for p in prompts[:2]]
    return [(tuple(o.outputs[0].token_ids), repr(o.outputs[0].logprobs)) for o in results]


def report_difference(outputs: list[tuple], reference: list[tuple]) -> None:
    """Print the first request whose tokens or logprobs differ from the reference's."""
    for i, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(zip(outputs, reference)):
        if tokens != ref_tokens:
            at = next(j for j, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b)
            print(f"  request {i}: token {at} differs ({tokens[at]} vs {ref_tokens[at]})")
            return
        if logprobs != ref_logprobs:
            print(f"  request {i}: same tokens, logprobs differ")
            return


def run_engine(model: str, extra: dict, dependent_launch: bool, iters: int) -> tuple[float, list]:
    settings = engine_args(model, max_num_seqs=8, dependent_launch=dependent_launch, **extra)
    started = time.perf_counter()
    llm = LLM(**settings)
    try:
        print(f"  engine up in {time.perf_counter() - started:.1f} s", flush=True)
        outputs = outputs_of(llm)
        tpot = bench.latency_of_client(llm.client, 128, 256, iters)["tpot_ms"]
    finally:
        llm.shutdown()
        free_gpu()
    return tpot, outputs


def throughput_rows(name: str) -> list[str]:
    """W1 / W2 with dependent_launch off, then on: one engine each."""
    model, num, input_len, output_len = WORKLOADS[name]
    vocab = int(read_hf_config(model)["vocab_size"])
    workload = bench.random_workload(num, input_len, output_len, vocab, seed=0)
    rows = []
    for dependent_launch in (False, True):
        settings = engine_args(model, max_num_seqs=1024, max_num_batched_tokens=16384,
                               dependent_launch=dependent_launch)  # fmt: skip
        result = bench.run_pagedserve(workload, settings)
        free_gpu()
        rows.append(f"| {name} | {dependent_launch} | {result.elapsed_s:.2f} | "
                    f"{result.output_tok_s:,.0f} | {result.req_s:.2f} |")  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", default=["qwen3", "llama", "fp8", "int4"])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--workloads", nargs="*", default=[], choices=["W1", "W2"])
    parser.add_argument("--ttft", nargs="*", default=[], choices=["qwen3", "llama"])
    args = parser.parse_args()
    throughput = [row for name in args.workloads for row in throughput_rows(name)]
    ttft = []
    for name in args.ttft:
        model = {"qwen3": QWEN, "llama": LLAMA}[name]
        off, on = (offline_ttft(model, dependent_launch=flag) for flag in (False, True))
        ttft.append(f"| {name} | {off:.2f} | {on:.2f} | {off / on:.3f} |")
        print(ttft[-1], flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        table = variants(Path(root))
        for name in args.only:
            model, extra = table[name]
            times: dict[bool, list[float]] = {False: [], True: []}
            reference, equal = None, True
            for _ in range(args.rounds):
                for dependent_launch in (False, True):
                    tpot, outputs = run_engine(model, extra, dependent_launch, args.iters)
                    reference = outputs if reference is None else reference
                    equal = equal and outputs == reference
                    report_difference(outputs, reference)
                    times[dependent_launch].append(tpot)
                    print(f"{name} dependent_launch={dependent_launch}: {tpot:.3f} ms/token, "
                          f"outputs equal so far: {equal}", flush=True)  # fmt: skip
            off, on = statistics.mean(times[False]), statistics.mean(times[True])
            rows.append(f"| {name} | {off:.3f} | {on:.3f} | {off / on:.3f} | {equal} |")
    print("\n| variant (W3, batch 1) | off ms/token | on ms/token | speed-up | outputs equal |")
    print("|---|---:|---:|---:|---|")
    print("\n".join(rows))
    if throughput:
        print("\n| workload | dependent_launch | wall s | output tok/s | req/s |")
        print("|---|---|---:|---:|---:|")
        print("\n".join(throughput))
    if ttft:
        print("\n| offline TTFT, 128 tokens | off ms | on ms | speed-up |\n|---|---:|---:|---:|")
        print("\n".join(ttft))
    return 0 if all(row.endswith("True |") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
