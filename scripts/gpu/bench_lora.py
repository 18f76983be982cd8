"""LoRA adapters on the GPU: the kernels against their reference, a check against transformers,
then what adapters cost a decode-heavy workload. One markdown report:

    python scripts/gpu/bench_lora.py --out FILE [--requests 256] [--rank 16]

kernels the shrink / expand kernels (triton_lora.py) against their reference on Qwen3-0.6B's
        projections, eager and replayed in a CUDA graph with other slots than at capture, and
        their time a call.
check   a tiny Llama (float32, on the GPU) with two adapters and none in one batch: each
        request's greedy tokens must equal transformers' (CPU) on the model with its adapter
        merged into the weights (tests/test_lora.py's oracle), with max_loras 2 and 1.
timing  Qwen3-0.6B (dummy weights, bf16): REQUESTS prompts of 128 tokens, 128 output tokens each
        (ignore_eos), one engine a row: the plain engine, and enable_lora with no adapter, one
        adapter for every request, and four adapters spread over the requests (max_loras 4);
        random adapters of rank RANK on all seven projections; CUDA graphs on. Output tokens
        per second, and a lone request's time per token.
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_workloads import QWEN, engine_args, free_gpu  # noqa: E402

from pagedserve import LLM, LoRARequest, SamplingParams  # noqa: E402
from pagedserve.models.lora_format import AdapterConfig, expected_shapes  # noqa: E402
from pagedserve.models.model_config import load_model_config  # noqa: E402
from tests.tiny_models import (  # noqa: E402
    hf_greedy,
    load_hf_model,
    merge_lora,
    random_prompts,
    save_lora_adapter,
    save_tiny_model,
)


def check(root: Path) -> list[str]:
    base = save_tiny_model("llama", root / "tiny")
    adapters = {
        "a": save_lora_adapter(base, root / "a", seed=1),
        "b": save_lora_adapter(base, root / "b", seed=2, rank=8, targets=["q_proj", "down_proj"]),
    }
    prompts = random_prompts(400, [40, 7, 23], seed=5)
    names = ["a", "b", None] * 3
    loras = [None if n is None else LoRARequest(n, i, str(adapters[n]))
             for n, i in zip(names, [1, 2, 0] * 3)]  # fmt: skip
    models = {None: load_hf_model(base), **{n: merge_lora(base, p) for n, p in adapters.items()}}
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    lines = [
        "| engine | adapter: each request against transformers (greedy tokens equal, or where"
        " they differ; the largest logprob gap of the engine's tokens, teacher-forced) |",
        "|---|---|",
    ]
    for max_loras in (0, 2, 1):
        lora = {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": 8}
        with LLM(str(base), num_kv_blocks=256, device="cuda", **(lora if max_loras else {})) as llm:
            outputs = llm.generate(prompts * 3, greedy, lora_request=loras if max_loras else None)
        verdicts: dict[str | None, list[str]] = {name: [] for name in models}
        for out, name, prompt in zip(outputs, names, prompts * 3):
            name = name if max_loras else None
            verdicts[name].append(verdict(models[name], prompt, out.outputs[0]))
        label = f"max_loras {max_loras}" if max_loras else "plain engine (no LoRA)"
        counts = "; ".join(f"{name or 'none'}: {' '.join(v)}" for name, v in verdicts.items())
        lines.append(f"| {label} | {counts} |")
        free_gpu()
    return lines


def verdict(model, prompt: list[int], completion) -> str:
    """ "equal" or "differs-at-i" against transformers' greedy tokens, and the largest gap
    between the engine's logprob of each of its tokens and transformers' logprob of the same
    token after the same tokens (teacher-forced): ~1e-2 for TF32 noise, O(1) for a wrong
    delta."""
    tokens = completion.token_ids
    expected = hf_greedy(model, prompt, len(tokens))[0]
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    forced = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens]
    got = torch.tensor([lp[t].logprob for lp, t in zip(completion.logprobs, tokens)])
    gap = float((forced - got).abs().max())
    if tokens == expected:
        return f"equal({gap:.3f})"
    at = next(i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b)
    return f"differs-at-{at}({gap:.3f})"


def random_adapter(path: Path, model: str, rank: int, seed: int) -> Path:
    """A PEFT adapter of random A, B for `model`'s shapes (all seven projections)."""
    import json

    from safetensors.torch import save_file

    targets = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
    config = AdapterConfig(rank, 1.0, targets)
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        for name, shape in expected_shapes(load_model_config(model), config).items()
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    peft = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(targets)}
    (path / "adapter_config.json").write_text(json.dumps(peft))
    return path


QWEN_PROJECTIONS = {  # Qwen3-0.6B: input size, fused parts' output sizes
    "qkv": (1024, [2048, 1024, 1024]),
    "o": (2048, [1024]),
    "gate_up": (1024, [3072, 3072]),
    "down": (3072, [1024]),
}


def kernels() -> list[str]:
    """add_lora_delta on the GPU against reference_lora_delta (CPU, fp32) on Qwen3-0.6B's
    projections, 4 slots of rank 16: eager with tokens of every slot and none, and replayed in
    a CUDA graph captured with every token on slot 0, then given the mixed step; µs a call
    (bf16) in a graph of 20 calls."""
    from pagedserve.kernels.triton_lora import add_lora_delta, reference_lora_delta
    from pagedserve.models.lora import tokens_by_slot

    gen = torch.Generator().manual_seed(0)
    lines = [
        "| projection | dtype | tokens | max error / max delta: eager, graph | µs a call |",
        "|---|---|---:|---:|---:|",
    ]
    step_us: dict[int, float] = {}
    capacity, slots_n, rank = 256, 4, 16
    for name, (k, sizes) in QWEN_PROJECTIONS.items():
        n = sum(sizes)
        for dtype in (torch.bfloat16, torch.float32):
            for t in (1, 8, 64, 256):
                x = torch.randn(t, k, generator=gen).to(dtype)
                a = (torch.randn(slots_n, len(sizes), rank, k, generator=gen) * 0.05).to(dtype)
                b = (torch.randn(slots_n, n, rank, generator=gen) * 0.05).to(dtype)
                y = torch.randn(t, n, generator=gen).to(dtype)
                mixed = np.array([i % (slots_n + 1) - 1 for i in range(t)])  # -1 (none) .. 3
                delta = reference_lora_delta(x, a, b, torch.from_numpy(mixed), sizes)
                want = y.float() + delta
                cuda = [v.cuda() for v in (x, a, b, y)]
                xd, ad, bd, yd = cuda

                def metadata(slots: np.ndarray) -> torch.Tensor:
                    return torch.from_numpy(tokens_by_slot(slots, slots_n, capacity)).cuda()

                meta = metadata(mixed)
                out = yd.clone()
                add_lora_delta(xd, out, ad, bd, meta[:capacity], meta[capacity:], sizes)
                scale = float(delta.abs().max()) or 1.0
                eager = float((out.cpu().float() - want).abs().max()) / scale
                meta.copy_(metadata(np.zeros(t, np.int64)))
                out = yd.clone()
                graph = torch.cuda.CUDAGraph()
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    add_lora_delta(xd, out, ad, bd, meta[:capacity], meta[capacity:], sizes)
                meta.copy_(metadata(mixed))
                out.copy_(yd)
                graph.replay()
                replayed = float((out.cpu().float() - want).abs().max()) / scale
                us = ""
                if dtype == torch.bfloat16:
                    meta.copy_(metadata(np.zeros(t, np.int64)))  # every token adapted
                    timed = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(timed):
                        for _ in range(20):
                            add_lora_delta(xd, out, ad, bd, meta[:capacity], meta[capacity:], sizes)
                    timed.replay()
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    for _ in range(10):
                        timed.replay()
                    torch.cuda.synchronize()
                    call = (time.perf_counter() - start) / 200 * 1e6
                    step_us[t] = step_us.get(t, 0.0) + call
                    us = f"{call:.1f}"
                bound = 1e-4 if dtype == torch.float32 else 2e-2
                verdict = "ok" if max(eager, replayed) < bound else "**FAIL**"
                lines.append(
                    f"| {name} | {str(dtype)[6:]} | {t} | {eager:.1e}, {replayed:.1e} {verdict} "
                    f"| {us} |"
                )
    for t, us in step_us.items():
        lines.append(f"| 28 layers x the four (Qwen3-0.6B step) | bf16 | {t} | | {28 * us:.0f} |")
    return lines


def timing(root: Path, requests: int, rank: int) -> list[str]:
    vocab = int(load_model_config(QWEN).vocab_size)
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(128)] for _ in range(requests)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    loras = [
        LoRARequest(f"r{i}", i + 1, str(random_adapter(root / f"r{i}", QWEN, rank, i)))
        for i in range(4)
    ]
    rows = [
        ("plain (CUDA graphs)", {}, None),
        ("enable_lora, no adapter", {"enable_lora": True, "max_lora_rank": rank}, None),
        ("enable_lora, 1 adapter", {"enable_lora": True, "max_lora_rank": rank}, [loras[0]]),
        ("enable_lora, 4 adapters", {"enable_lora": True, "max_lora_rank": rank, "max_loras": 4},
         loras),
    ]  # fmt: skip
    lines = [
        f"| engine | {requests} requests: output tok/s | vs plain | batch 1: ms / token |",
        "|---|---:|---:|---:|",
    ]
    plain = None
    for label, extra, adapters in rows:
        with LLM(**engine_args(QWEN, **extra)) as llm:
            per_prompt = None if adapters is None else [adapters[i % len(adapters)]
                                                        for i in range(requests)]  # fmt: skip
            llm.generate(prompts[:8], params, use_tqdm=False, lora_request=(
                None if per_prompt is None else per_prompt[:8]))  # fmt: skip
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
            rate = requests * 128 / (time.perf_counter() - start)
            one = None if adapters is None else adapters[0]
            start = time.perf_counter()
            llm.generate(prompts[:1], params, use_tqdm=False, lora_request=one)
            latency = (time.perf_counter() - start) / 128 * 1e3
        plain = plain or rate
        lines.append(f"| {label} | {rate:,.0f} | {rate / plain:.2f} | {latency:.3f} |")
        print(lines[-1], flush=True)
        free_gpu()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--only", nargs="+", default=["kernels", "check", "timing"])
    args = parser.parse_args()
    report = [f"# LoRA on {torch.cuda.get_device_name()}, {datetime.datetime.now():%Y-%m-%d %H:%M}"]
    with tempfile.TemporaryDirectory() as tmp:
        parts = {
            "kernels": kernels,
            "check": lambda: check(Path(tmp)),
            "timing": lambda: timing(Path(tmp), args.requests, args.rank),
        }
        for title, run in parts.items():
            if title not in args.only:
                continue
            report.append(f"\n## {title}\n")
            try:
                report += run()
            except Exception:
                report.append("```\n" + traceback.format_exc() + "```")
            print("\n".join(report), flush=True)
    Path(args.out).write_text("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
