"""`pagedserve bench throughput | latency`, in the style of `vllm bench`.

Workloads are synthetic and seeded: per request, draw the input length, then the output length,
then the prompt ids, from one `random.Random(seed)`. EOS is ignored so every request produces
exactly its output length. `--backend hf` runs the same workload through Hugging Face
transformers (static-batch `generate`; `hf-cb` uses its continuous-batching `generate_batch`),
so every table can have its peer in the same run.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

Workload = list[tuple[list[int], int]]


@dataclass
class BenchResult:
    backend: str
    num_requests: int
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int
    spec_decode: dict[str, float] | None = None  # speculative decoding's counts and rates

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def req_s(self) -> float:
        return self.num_requests / self.elapsed_s

    def row(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "output_tok_s": round(self.output_tok_s, 1),
            "req_s": round(self.req_s, 2),
        }


def random_workload(
    num: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> Workload:
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        n_in, n_out = rng.randint(*input_len), rng.randint(*output_len)
        requests.append(([rng.randrange(vocab_size) for _ in range(n_in)], n_out))
    return requests


def run_pagedserve(workload: Workload, engine_args: dict[str, Any]) -> BenchResult:
    from pagedserve import LLM, SamplingParams

    with LLM(**engine_args) as llm:
        llm.generate([workload[0][0]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm up
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload
        ]
        before = llm.get_stats()
        start = time.perf_counter()
        outputs = llm.generate([p for p, _ in workload], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        after = llm.get_stats()
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    spec = spec_decode_summary(before, after) if "speculative_config" in engine_args else None
    return BenchResult(
        "pagedserve", len(workload), elapsed, sum(len(p) for p, _ in workload), produced, spec
    )


def spec_decode_summary(before: Any, after: Any) -> dict[str, float]:
    """Speculative decoding over a run (two SchedulerStats): drafts, proposed / accepted /
    emitted tokens, the acceptance rate and the mean accepted length (tokens per verify)."""
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens")
    counts = {k: getattr(after, f"spec_{k}") - getattr(before, f"spec_{k}") for k in keys}
    drafts, proposed = max(counts["num_drafts"], 1), max(counts["num_draft_tokens"], 1)
    return {
        **counts,
        "acceptance_rate": round(counts["num_accepted_tokens"] / proposed, 4),
        "mean_accepted_length": round(counts["num_emitted_tokens"] / drafts, 3),
    }


def load_hf_model(model: str, load_format: str, dtype: str, device: str, attn: str | None = None):
    import torch
    import transformers

    from pagedserve.config import resolve_model_path

    path = resolve_model_path(model)
    torch_dtype = {
        "auto": torch.bfloat16 if device == "cuda" else torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "float32": torch.float32,
    }[dtype]
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if attn:
        kwargs["attn_implementation"] = attn
    if load_format == "dummy":
        config = transformers.AutoConfig.from_pretrained(path)
        with torch.device(device):
            model_obj = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    else:
        model_obj = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device)
    model_obj.generation_config.eos_token_id = None
    return model_obj.eval()


def run_hf_static(workload: Workload, model: Any, batch_size: int) -> BenchResult:
    """Static batching: each batch is left-padded and runs until its longest output is done;
    only the tokens each request asked for count as output."""
    import torch

    device = next(model.parameters()).device
    start = time.perf_counter()
    for i in range(0, len(workload), batch_size):
        batch = workload[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        longest = max(n for _, n in batch)
        with torch.inference_mode():
            model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                do_sample=False,
                max_new_tokens=longest,
                min_new_tokens=longest,
                pad_token_id=0,
            )
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return BenchResult(
        f"hf-static(batch={batch_size})",
        len(workload),
        elapsed,
        sum(len(p) for p, _ in workload),
        sum(n for _, n in workload),
    )


def run_hf_continuous(workload: Workload, model: Any, max_batch_tokens: int) -> BenchResult:
    """transformers' own continuous batching (`generate_batch`), paged attention."""
    import transformers

    longest = max(n for _, n in workload)
    config = transformers.GenerationConfig(
        max_new_tokens=longest,
        do_sample=False,
        eos_token_id=None,
        max_batch_tokens=max_batch_tokens,
    )
    start = time.perf_counter()
    outputs = model.generate_batch([p for p, _ in workload], generation_config=config)
    elapsed = time.perf_counter() - start
    produced = sum(min(len(o.generated_tokens), n) for o, (_, n) in zip(outputs.values(), workload))
    return BenchResult(
        "hf-continuous-batching", len(workload), elapsed, sum(len(p) for p, _ in workload), produced
    )


def latency_pagedserve(
    engine_args: dict[str, Any], input_len: int, output_len: int, iters: int
) -> dict[str, float]:
    """Batch 1: time per output token = (e2e - ttft) / (output_len - 1), via streaming."""
    from pagedserve.actors.supervisor import Supervisor
    from pagedserve.api.client import Client
    from pagedserve.config import EngineConfig

    supervisor = Supervisor(EngineConfig(**engine_args))
    supervisor.start()
    try:
        credentials = supervisor.credentials.for_clients()
        with Client(supervisor.addresses.engine_address, credentials=credentials) as client:
            return latency_of_client(client, input_len, output_len, iters)
    finally:
        supervisor.stop()


def latency_of_client(client: Any, input_len: int, output_len: int, iters: int) -> dict[str, float]:
    """latency_pagedserve's measure on an engine's running ZeroMQ client: `iters` random
    prompts after a warm-up one, medians."""
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    tpots, ttfts = [], []
    for i in range(iters + 1):
        prompt = random_workload(1, (input_len, input_len), (1, 1), 1000, seed=i)[0][0]
        start = time.perf_counter()
        stamps = [time.perf_counter() for _ in client.generate(prompt, params)]
        if i == 0:
            continue  # warm-up
        ttfts.append(stamps[0] - start)
        tpots.append((stamps[-1] - stamps[0]) / max(1, len(stamps) - 1))
    return {"tpot_ms": statistics.median(tpots) * 1e3, "ttft_ms": statistics.median(ttfts) * 1e3}


def latency_hf(model: Any, input_len: int, output_len: int, iters: int) -> dict[str, float]:
    import torch

    device = next(model.parameters()).device
    prompt = torch.tensor([random_workload(1, (input_len, input_len), (1, 1), 1000)[0][0]])
    times = []
    for i in range(iters + 1):
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                prompt.to(device),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=0,
            )
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return {"tpot_ms": statistics.median(times) / output_len * 1e3}


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))
