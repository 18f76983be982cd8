"""Can cuDNN's attention take long prefill chunks off the Triton paged kernel? (issue 15)

Llama-3.1-8B heads (32 q / 8 kv, head_dim 128, bf16, block size 16). Each request's K/V is
gathered from the paged cache (one index_select a tensor, no head expansion: enable_gqa) and
its queries are a strided view of the step's q; every variant is checked against the float32
reference before it is timed:

- fresh chunks (32 prompts of 7-8k tokens, nothing cached): Triton vs cuDNN causal;
- continuation chunks (32 requests, 500-3,500 tokens cached, 4,000-5,000 new): Triton vs cuDNN
  with a bottom-right boolean mask vs cuDNN in two calls (cached keys unmasked, own keys
  causal) merged by their log-sum-exps (aten's cuDNN op returns them);
- the 32 x 7-8k workload at max_num_batched_tokens 8,192 (the default) and 16,384 (vLLM's
  offline default on this GPU).

    PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu/dense_prefill_probe.py [--skip-attention]
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts" / "gpu")]

from sweep_prefill import BLOCK_SIZE, HEAD_DIM, Step, make_step, triton_fn  # noqa: E402

from pagedserve.api import bench  # noqa: E402
from pagedserve.kernels import attention_ref  # noqa: E402

LLAMA = str(ROOT / "scripts" / "gpu" / "configs" / "llama-3.1-8b")
SCALE = HEAD_DIM**-0.5
SUMMARY: list[str] = []


def requests(step: Step) -> list[tuple[int, int, int, torch.Tensor]]:
    """(query start, query len, context len, block ids on the device) per request."""
    md = step.metadata
    starts = md.query_start_loc.tolist()
    out = []
    for b, (q_len, ctx) in enumerate(zip(md.query_lens_cpu.tolist(), md.seq_lens_cpu.tolist())):
        out.append((starts[b], q_len, ctx, md.block_tables[b, : triton.cdiv(ctx, BLOCK_SIZE)]))
    return out


def gather(cache: torch.Tensor, blocks: torch.Tensor, ctx: int) -> torch.Tensor:
    """[1, kv_heads, ctx, d] (a transposed view) of one request's cached rows."""
    return cache.index_select(0, blocks).flatten(0, 1)[:ctx].transpose(0, 1)[None]


def cudnn_sdpa(step: Step, masked: bool) -> Callable[[], torch.Tensor]:
    """cuDNN per request: causal (fresh chunks) or with a bottom-right boolean mask."""
    out, reqs = torch.empty_like(step.q), requests(step)
    masks = [
        torch.ones(q_len, ctx, dtype=torch.bool, device="cuda").tril(ctx - q_len)
        if masked else None
        for _, q_len, ctx, _ in reqs
    ]  # fmt: skip

    def run() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for (start, q_len, ctx, blocks), mask in zip(reqs, masks):
                q = step.q[start : start + q_len].transpose(0, 1)[None]
                k, v = gather(step.k_cache, blocks, ctx), gather(step.v_cache, blocks, ctx)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not masked,
                                                   scale=SCALE, enable_gqa=True)  # fmt: skip
                out[start : start + q_len] = o[0].transpose(0, 1)
        return out

    return run


def cudnn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):  # type: ignore[no-untyped-def]
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=SCALE
    )[:2]
    return o, lse


def cudnn_split(step: Step, merge: bool = True) -> Callable[[], torch.Tensor]:
    out, reqs = torch.empty_like(step.q), requests(step)

    def run() -> torch.Tensor:
        for start, q_len, ctx, blocks in reqs:
            q = step.q[start : start + q_len].transpose(0, 1)[None]
            k, v = gather(step.k_cache, blocks, ctx), gather(step.v_cache, blocks, ctx)
            cached = ctx - q_len
            o2, l2 = cudnn_op(q, k[:, :, cached:], v[:, :, cached:], True)
            if cached == 0:
                out[start : start + q_len] = o2[0].transpose(0, 1)
                continue
            o1, l1 = cudnn_op(q, k[:, :, :cached], v[:, :, :cached], False)
            if not merge:
                continue
            l1, l2 = l1.reshape(o1.shape[:-1])[..., None], l2.reshape(o2.shape[:-1])[..., None]
            lse = torch.logaddexp(l1, l2)
            o = o1.float() * torch.exp(l1 - lse) + o2.float() * torch.exp(l2 - lse)
            out[start : start + q_len] = o[0].transpose(0, 1).to(out.dtype)
        return out

    return run


def attention() -> None:
    gen = torch.Generator().manual_seed(0)
    fresh = [(0, int(n)) for n in torch.randint(7000, 8001, (32,), generator=gen)]
    cont = [
        (int(p), int(n))
        for p, n in zip(
            torch.randint(500, 3501, (32,), generator=gen),
            torch.randint(4000, 5001, (32,), generator=gen),
        )
    ]
    checks = {"fresh": [(0, 1000), (0, 300), (0, 77)], "cont": [(700, 900), (64, 300), (5, 77)]}
    shapes = {"fresh": fresh, "cont": cont}
    engine_kernel = lambda s: triton_fn(s, None, True)  # noqa: E731 - the engine's tiles
    variants: dict[str, dict[str, Callable[[Step], Callable[[], torch.Tensor]]]] = {
        "fresh": {"triton": engine_kernel, "cudnn causal": lambda s: cudnn_sdpa(s, masked=False),
                  "cudnn op": cudnn_split},
        "cont": {"triton": engine_kernel, "cudnn mask": lambda s: cudnn_sdpa(s, masked=True),
                 "cudnn split": cudnn_split,
                 "cudnn split, no merge": lambda s: cudnn_split(s, merge=False)},
    }  # fmt: skip
    for kind, fns in variants.items():
        check = make_step(checks[kind], 32, 8, seed=1)
        expected = attention_ref.paged_attention(
            check.q.float(), check.k_cache.float(), check.v_cache.float(), check.metadata, SCALE
        )
        step = make_step(shapes[kind], 32, 8, seed=2)
        for name, make in fns.items():
            try:
                first = time.perf_counter()
                got = make(check)().float()
                error = (got - expected).abs().max().item() if "no merge" not in name else 0.0
                first = time.perf_counter() - first
                ms = triton.testing.do_bench(make(step), warmup=3, rep=30, return_mode="median")
                SUMMARY.append(f"| {kind} 32 requests: {name} | {step.flops / ms / 1e9:.0f} "
                               f"TFLOP/s, {ms:.1f} ms a layer | err {error:.1e}, first "
                               f"call {first:.1f} s |")  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - report, continue
                traceback.print_exc()
                SUMMARY.append(f"| {kind}: {name} | FAIL {type(exc).__name__}: "
                               f"{str(exc)[:100]} | |")  # fmt: skip
            print(SUMMARY[-1], flush=True)


def workloads() -> None:
    for budget in (8192, 16384):
        workload = bench.random_workload(32, (7000, 8000), (64, 64), 1000, seed=5)
        args = dict(model=LLAMA, load_format="dummy", skip_tokenizer_init=True,
                    max_model_len=8192, device="cuda", max_num_batched_tokens=budget)  # fmt: skip
        result = bench.run_pagedserve(workload, args)
        SUMMARY.append(f"| workload, max_num_batched_tokens {budget} | {result.elapsed_s:.2f} s "
                       f"| {result.output_tok_s:.0f} out tok/s |")  # fmt: skip
        print(SUMMARY[-1], flush=True)
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-attention", action="store_true", help="only the workloads")
    skip_attention = parser.parse_args().skip_attention
    schema = torch.ops.aten._scaled_dot_product_cudnn_attention.default._schema
    print(f"torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}\n{schema}")
    if not skip_attention:
        attention()
    workloads()
    print("\n| part | figure | note |\n|---|---:|---|\n" + "\n".join(SUMMARY))


if __name__ == "__main__":
    main()
