"""Mixture-of-experts models on the GPU: the kernels against their reference, the engine against
transformers, then what a Qwen3-30B-A3B-shaped model costs. One markdown report:

    python scripts/gpu/check_moe.py --out FILE [--only kernels check timing]

kernels  fused_experts (kernels.triton_moe) on Qwen3-30B-A3B's expert shapes (128 experts,
         top 8, hidden 2048, intermediate 768) against kernels.moe_ref in fp32 on the same
         inputs: bf16 and fp32, 1 to 2,048 tokens, eager and replayed in a CUDA graph captured
         with one routing and given another; µs a call (bf16, a graph of 20 calls) and the
         bandwidth of the expert weights it reads; then the same experts in fp8 and in int4
         (groups of 128, as Qwen3-30B-A3B-GPTQ-Int4's) against their dequantized weights.
check    tiny fp32 Qwen3-MoE, Mixtral and Qwen2-MoE models (tests/test_moe.py's) through `LLM`
         on the GPU in float32 (dtype "auto" would run them in bf16), greedy, against
         transformers on the CPU: equal tokens, or where they differ, and the largest logprob
         gap of the engine's tokens (teacher-forced); with the Triton attention and CUDA graphs,
         and with the torch reference attention, eager.
timing   Qwen3-30B-A3B's shape with dummy bf16 weights, and quantized at load to fp8 and to
         int4 (quantization "gptq" on dummy weights: groups of 128): batch-1 time per output
         token (128-token prompt, 128 tokens out) and 256 prompts of 128 tokens, 128 out:
         output tokens / s.
         Roofline: a batch-1 step reads the active weights, ~3.0 B parameters (6.1 GB).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lora import verdict  # noqa: E402
from bench_workloads import CONFIGS, engine_args, free_gpu  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.kernels import moe_ref  # noqa: E402
from pagedserve.models.model_config import load_model_config  # noqa: E402
from tests.test_moe import MOE_CONFIGS, save_moe_model  # noqa: E402
from tests.tiny_models import random_prompts  # noqa: E402

QWEN_MOE = str(CONFIGS / "qwen3-30b-a3b")
EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768


def graph_seconds(call: Callable[[], object]) -> float:
    """Seconds a call, replayed 200 times from a CUDA graph of 20 calls (after one eager call:
    the kernels compile outside the capture)."""
    call()
    torch.cuda.synchronize()
    timed = torch.cuda.CUDAGraph()
    with torch.cuda.graph(timed):
        for _ in range(20):
            call()
    timed.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        timed.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 200


def kernels() -> list[str]:
    from pagedserve.kernels.triton_moe import _tiles, align_by_expert, fused_experts

    gen = torch.Generator().manual_seed(0)
    lines = [
        "| dtype | tokens | max error / max output: eager, graph | µs a call | of which align µs "
        "| experts read GB/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.03
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.03
    for dtype in (torch.bfloat16, torch.float32):
        w13d, w2d = w13.to(dtype).cuda(), w2.to(dtype).cuda()
        for t in (1, 8, 64, 512, 2048):
            x = torch.randn(t, HIDDEN, generator=gen).to(dtype)
            routes = []
            for _ in range(2):
                draws = [torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(t)]
                ids = torch.stack(draws)
                weights = torch.rand(t, TOP_K, generator=gen)
                routes.append((weights / weights.sum(-1, keepdim=True), ids))
            weights, ids = routes[1]
            want = moe_ref.fused_experts(
                x.float().cuda(), w13d.float(), w2d.float(), weights.cuda(), ids.cuda()
            ).cpu()
            scale = float(want.abs().max())
            xd = x.cuda()
            wd, idd = routes[0][0].cuda(), routes[0][1].cuda()
            eager_out = fused_experts(xd, w13d, w2d, weights.cuda(), ids.cuda())
            eager = float((eager_out.float().cpu() - want).abs().max()) / scale
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fused_experts(xd, w13d, w2d, wd, idd)
            wd.copy_(weights)
            idd.copy_(ids)
            graph.replay()
            replayed = float((out.float().cpu() - want).abs().max()) / scale
            us, rate = "", ""
            if dtype == torch.bfloat16:
                block_m = _tiles(t * TOP_K, EXPERTS).block_m
                call = graph_seconds(functools.partial(fused_experts, xd, w13d, w2d, wd, idd))
                align = graph_seconds(functools.partial(align_by_expert, idd, EXPERTS, block_m))
                hit = len(torch.unique(ids))
                read = hit * 3 * INTER * HIDDEN * 2
                us = f"{call * 1e6:.1f} | {align * 1e6:.1f}"
                rate = f"{read / call / 1e9:,.0f}"
            us = us or " | "
            bound = 1e-4 if dtype == torch.float32 else 2e-2
            ok = "ok" if max(eager, replayed) < bound else "**FAIL**"
            lines.append(
                f"| {str(dtype)[6:]} | {t} | {eager:.1e}, {replayed:.1e} {ok} | {us} | {rate} |"
            )
            print(lines[-1], flush=True)
        free_gpu()
    lines += fp8_kernels(w13, w2)
    lines += int4_kernels(w13, w2)
    return lines


def fp8_kernels(w13: torch.Tensor, w2: torch.Tensor) -> list[str]:
    """The same experts in fp8 (a scale per output channel), bf16 activations, against the
    reference on their dequantized weights in fp32."""
    from pagedserve.kernels import quant_ref
    from pagedserve.kernels.triton_moe import fused_experts

    gen = torch.Generator().manual_seed(1)
    (q13, s13), (q2, s2) = (quant_ref.quantize_fp8_rows(w.cuda()) for w in (w13, w2))
    scales = (s13.squeeze(-1).contiguous(), s2.squeeze(-1).contiguous())
    dequantized = (q13.float() * scales[0][..., None], q2.float() * scales[1][..., None])
    lines = []
    for t in (1, 8, 64, 512):
        x = torch.randn(t, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
        draws = [torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(t)]
        ids = torch.stack(draws).cuda()
        weights = torch.rand(t, TOP_K, generator=gen).cuda()
        got = fused_experts(x, q13, q2, weights, ids, scales=scales)
        want = moe_ref.fused_experts(x.float(), *dequantized, weights, ids)
        error = float((got.float() - want).abs().max()) / float(want.abs().max())
        call = graph_seconds(functools.partial(fused_experts, x, q13, q2, weights, ids,
                                               scales=scales))  # fmt: skip
        read = len(torch.unique(ids)) * 3 * INTER * HIDDEN
        ok = "ok" if error < 2e-2 else "**FAIL**"
        lines.append(f"| fp8 experts | {t} | {error:.1e} {ok} | {call * 1e6:.1f} | | "
                     f"{read / call / 1e9:,.0f} |")  # fmt: skip
        print(lines[-1], flush=True)
    return lines


def int4_kernels(w13: torch.Tensor, w2: torch.Tensor) -> list[str]:
    """The same experts in int4 (groups of 128, asymmetric), bf16 activations, against the
    reference on their dequantized weights in fp32."""
    from pagedserve.kernels import quant_ref
    from pagedserve.kernels.triton_moe import fused_experts

    gen = torch.Generator().manual_seed(2)
    int4 = []
    for w in (w13, w2):
        quantized = [quant_ref.quantize_int_weight(e.cuda(), 4, 128, False) for e in w]
        int4.append(moe_ref.Int4Experts(
            torch.stack([q.qweight for q in quantized]),
            torch.stack([q.scales for q in quantized]).to(torch.bfloat16),
            torch.stack([q.zeros for q in quantized]).to(torch.bfloat16), 128,
        ))  # fmt: skip
    exact = [moe_ref.Int4Experts(w.qweight, w.scales.float(), w.zeros.float(), 128) for w in int4]
    lines = []
    for t in (1, 8, 64, 512):
        x = torch.randn(t, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
        draws = [torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(t)]
        ids = torch.stack(draws).cuda()
        weights = torch.rand(t, TOP_K, generator=gen).cuda()
        got = fused_experts(x, *int4, weights, ids)
        want = moe_ref.fused_experts(x.float(), *exact, weights, ids)
        error = float((got.float() - want).abs().max()) / float(want.abs().max())
        call = graph_seconds(functools.partial(fused_experts, x, *int4, weights, ids))
        read = len(torch.unique(ids)) * 3 * INTER * HIDDEN * (0.5 + 2 * 2 / 128)
        ok = "ok" if error < 2e-2 else "**FAIL**"
        lines.append(f"| int4 experts (g128) | {t} | {error:.1e} {ok} | {call * 1e6:.1f} | | "
                     f"{read / call / 1e9:,.0f} |")  # fmt: skip
        print(lines[-1], flush=True)
    return lines


def check(root: Path) -> list[str]:
    lines = [
        "| model | each request against transformers (greedy tokens equal, or where they differ;"
        " the largest logprob gap, teacher-forced) |",
        "|---|---|",
    ]
    prompts = random_prompts(400, [40, 7, 23, 1, 64], seed=5)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    settings = {
        "": {},  # the engine's GPU path: Triton attention, CUDA graphs
        ", torch_ref attention (exact fp32), eager": {
            "attention_backend": "torch_ref", "enforce_eager": True,
        },
    }  # fmt: skip
    for arch in sorted(MOE_CONFIGS):
        model = save_moe_model(arch, root / arch)
        for label, extra in settings.items():
            with LLM(str(root / arch), skip_tokenizer_init=True, num_kv_blocks=256,
                     device="cuda", dtype="float32", **extra) as llm:  # fmt: skip
                outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
            verdicts = [verdict(model, p, o.outputs[0]) for p, o in zip(prompts, outputs)]
            lines.append(f"| {arch}{label} | {' '.join(verdicts)} |")
            print(lines[-1], flush=True)
            free_gpu()
    return lines


def timing() -> list[str]:
    vocab = int(load_model_config(QWEN_MOE).vocab_size)
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(128)] for _ in range(256)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    lines = [
        "| model | batch 1: ms / output token | 256 x (128 in, 128 out): output tok/s "
        "| start-up s |",
        "|---|---:|---:|---:|",
    ]
    variants = (("bf16", {}), ("fp8 (quantized at load)", {"quantization": "fp8"}),
                ("int4 g128 (quantized at load)", {"quantization": "gptq"}))  # fmt: skip
    for label, extra in variants:
        started = time.perf_counter()
        with LLM(**engine_args(QWEN_MOE, **extra)) as llm:
            load = time.perf_counter() - started
            llm.generate(prompts[:8], params, use_tqdm=False)
            start = time.perf_counter()
            llm.generate(prompts[:1], params, use_tqdm=False)
            latency = (time.perf_counter() - start) / 128 * 1e3
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            rate = 256 * 128 / (time.perf_counter() - start)
        free_gpu()
        lines.append(
            f"| Qwen3-30B-A3B shape, dummy {label} | {latency:.3f} | {rate:,.0f} | {load:.0f} |"
        )
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="+", default=["kernels", "check", "timing"])
    args = parser.parse_args()
    report = [f"# MoE on {torch.cuda.get_device_name()}, {datetime.datetime.now():%Y-%m-%d %H:%M}"]
    with tempfile.TemporaryDirectory() as tmp:
        parts = {"kernels": kernels, "check": lambda: check(Path(tmp)), "timing": timing}
        for title, run in parts.items():
            if title not in args.only:
                continue
            report.append(f"\n## {title}\n")
            try:
                report += run()
            except Exception:
                report.append("```\n" + traceback.format_exc() + "```")
            print("\n".join(report[-3:]), flush=True)
            Path(args.out).write_text("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
