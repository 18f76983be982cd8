"""GPU checks and timings of quantization (issue 13), one markdown report:

    python scripts/gpu/bench_quant.py --out FILE [--only kernels W3 W2]

kernels  every quantized-matmul kernel on the GPU against its reference (kernels.quant_ref, in
         fp32 from the very quantized values), on Llama-3.1-8B's projection shapes: the int4 /
         int8 / fp8 weight GEMV (batch 1, 4, 16), the large-batch paths (dequantize + cuBLAS,
         per-token fp8 + torch._scaled_mm, batch 256), the fp8 row quantizer; time per call
         (CUDA graph of cold-L2 calls, bench_kernels.Timer) next to bf16 (the Triton GEMV the
         engine uses at batch 1, cuBLAS) with the weight bytes read per second; and the fp8 KV
         cache: Triton's write and decode attention against the torch reference, and timed
         against a bf16 cache.
W3       batch-1 decode of Llama-3.1-8B (dummy weights): bf16, fp8 (quantization="fp8"), int4
         (a GPTQ quantization_config, groups of 128: the dummy weights quantized while loading)
         and int8; targets 2.3 ms (fp8) and 1.5 ms (int4) per token.
W2       Llama-3.1-8B, 1000 requests (bench_workloads' W2) with fp8 weights + fp8 KV cache, and
         bf16 in the same run; target 113 req/s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import MODELS, Timer, projection_shapes  # noqa: E402
from bench_workloads import LLAMA, WORKLOADS, engine_args, free_gpu  # noqa: E402

from pagedserve.api import bench  # noqa: E402
from pagedserve.config import read_hf_config  # noqa: E402
from pagedserve.kernels import quant_ref, triton_gemv, triton_quant  # noqa: E402

LLAMA_SHAPES = [s for s in projection_shapes(MODELS[1]) if s[0] != "lm_head"]
HEADER = ["| shape (N x K) | rows | implementation | µs | weight GB/s | rel. error |",
          "|---|---:|---|---:|---:|---:|"]  # fmt: skip


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def row(shape: str, m: int, name: str, us: float, nbytes: int, err: float | str) -> str:
    error = err if isinstance(err, str) else f"{err:.1e}"
    return f"| {shape} | {m} | {name} | {us:.1f} | {nbytes / us / 1e3:,.0f} | {error} |"


def schemes(w: torch.Tensor) -> dict[str, tuple[Callable, Callable, int]]:
    """name -> (kernel(x), reference(x) in fp32, weight bytes) for one bf16 weight [N, K]."""
    n, k = w.shape
    int4 = quant_ref.quantize_int_weight(w, 4, 128, symmetric=True)
    int8 = quant_ref.quantize_int_weight(w, 8, 128, symmetric=True)
    wq, w_scale = quant_ref.quantize_fp8_rows(w)
    w_scale = w_scale.squeeze(1).contiguous()
    deq4, deq8 = (quant_ref.dequantize_int_weight(q, torch.float32) for q in (int4, int8))
    fp8_deq = wq.float() * w_scale[:, None]
    return {
        "int4 g128 GEMV": (lambda x: triton_quant.int_weight_gemv(x, int4),
                           lambda x: F.linear(x.float(), deq4), n * k // 2),
        "int8 g128 GEMV": (lambda x: triton_quant.int_weight_gemv(x, int8),
                           lambda x: F.linear(x.float(), deq8), n * k),
        "fp8 GEMV (W8A16)": (lambda x: triton_quant.fp8_weight_gemv(x, wq, w_scale),
                             lambda x: F.linear(x.float(), fp8_deq), n * k),
        "fp8 _scaled_mm (W8A8)": (lambda x: scaled_mm(x, wq, w_scale),
                                  lambda x: quant_ref.fp8_linear(x.float(), wq, w_scale, None),
                                  n * k),
        "int4 dequantize + cuBLAS": (
            lambda x: F.linear(x, triton_quant.dequantize(int4, x.dtype)),
            lambda x: F.linear(x.float(), deq4), n * k // 2),
        "bf16 Triton GEMV": (lambda x: triton_gemv.skinny_linear(x, w),
                             lambda x: F.linear(x.float(), w.float()), 2 * n * k),
        "bf16 cuBLAS": (lambda x: F.linear(x, w), lambda x: F.linear(x.float(), w.float()),
                        2 * n * k),
    }  # fmt: skip


def scaled_mm(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The fp8 linear method's large-batch path."""
    xq, x_scale = triton_quant.quantize_fp8_rows(x)
    return torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1),
                            out_dtype=x.dtype)  # fmt: skip


def kernels(timer: Timer) -> list[str]:
    lines = ["### Quantized matmuls, Llama-3.1-8B projections (bf16 activations)\n", *HEADER]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k in LLAMA_SHAPES:
        w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
        for impl, (kernel, reference, nbytes) in schemes(w).items():
            small = "GEMV" in impl
            for m in (1, 4, 16) if small else (1, 16, 256):
                x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
                error = rel_error(kernel(x), reference(x))
                us = timer.graph(lambda kernel=kernel, x=x: kernel(x)) or timer.eager(
                    lambda kernel=kernel, x=x: kernel(x))  # fmt: skip
                lines.append(row(f"{name} {n}x{k}", m, impl, us, nbytes, error))
                print(lines[-1], flush=True)
        del w
        free_gpu()
    return lines + fp8_quantizer() + fp8_kv_cache(timer)


def fp8_quantizer() -> list[str]:
    x = torch.randn(256, 4096, device="cuda").bfloat16() * 3
    got, got_scale = triton_quant.quantize_fp8_rows(x)
    want, want_scale = quant_ref.quantize_fp8_rows(x)
    same = torch.equal(got.float(), want.float()) and torch.equal(got_scale, want_scale)
    return [f"\nfp8 per-token quantizer (256 x 4096 bf16) equals the reference: {same}\n"]


def fp8_kv_cache(timer: Timer) -> list[str]:
    """Decode attention, 64 requests x 2048 context, Llama-3.1-8B heads, bf16 vs fp8 cache."""
    from bench_kernels import attention_metadata_cpu, build_attention_metadata

    from pagedserve.kernels import attention_ref, triton_attention

    meta = attention_metadata_cpu([(2047, 1)] * 64, torch.Generator().manual_seed(1))
    md = build_attention_metadata(
        meta["query_lens"], meta["seq_lens"], meta["block_tables"], meta["slot_mapping"],
        16, torch.device("cuda"),
    )  # fmt: skip
    shape, scale = (meta["num_blocks"], 16, 8, 128), 128**-0.5
    k, v = (torch.randn(shape[0] * 16, 8, 128, device="cuda").bfloat16() for _ in range(2))
    q = torch.randn(64, 32, 128, device="cuda").bfloat16()
    slots = torch.arange(shape[0] * 16, device="cuda")
    lines = ["### fp8 KV cache (Triton), decode 64 x 2048, 32 / 8 heads of 128\n"]
    for dtype, kv_scale in ((torch.bfloat16, 1.0), (torch.float8_e4m3fn, 0.02)):
        kc, vc, ref_k, ref_v = (torch.zeros(shape, dtype=dtype, device="cuda") for _ in range(4))
        triton_attention.write_kv_cache(k, v, kc, vc, slots, kv_scale, kv_scale)
        attention_ref.write_kv_cache(k, v, ref_k, ref_v, slots, kv_scale, kv_scale)
        same = torch.equal(kc.float(), ref_k.float()) and torch.equal(vc.float(), ref_v.float())

        def attend(kc: torch.Tensor = kc, vc: torch.Tensor = vc, s: float = kv_scale) -> object:
            return triton_attention.paged_attention_backend(q, kc, vc, md, scale, s, s)

        dense = (kc.float() * kv_scale, vc.float() * kv_scale)
        want = attention_ref.paged_attention(q.float(), *dense, md, scale)
        us, error = timer.graph(attend) or timer.eager(attend), rel_error(attend(), want)
        lines.append(f"- {dtype} cache: write equals the reference: {same}; decode "
                     f"{us:.1f} µs, rel. error vs fp32 {error:.1e}")  # fmt: skip
        print(lines[-1], flush=True)
    return lines


def gptq_config_dir(root: Path) -> str:
    """Llama-3.1-8B's config with a GPTQ 4-bit, group-128 quantization_config."""
    target = root / "llama-3.1-8b-gptq"
    shutil.copytree(LLAMA, target)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                     "sym": True, "desc_act": False}  # fmt: skip
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


def w3(args: argparse.Namespace) -> list[str]:
    lines = ["### W3: Llama-3.1-8B batch 1, 128-token prompt, 256 output tokens\n",
             "| weights | time per output token ms |", "|---|---:|"]  # fmt: skip
    with tempfile.TemporaryDirectory() as root:
        variants = {"bf16": (LLAMA, {}), "fp8": (LLAMA, {"quantization": "fp8"}),
                    "int4 (GPTQ layout, g128)": (gptq_config_dir(Path(root)), {}),
                    "int8 (g128)": (LLAMA, {"quantization": "int8"})}  # fmt: skip
        for label, (model, extra) in variants.items():
            for run in range(args.repeat):
                settings = engine_args(model, max_num_seqs=8, **extra)
                result = bench.latency_pagedserve(settings, 128, 256, iters=3)
                free_gpu()
                lines.append(f"| {label} (engine {run + 1}) | {result['tpot_ms']:.2f} |")
                print(lines[-1], flush=True)
    return lines


def w2(args: argparse.Namespace) -> list[str]:
    model, num, input_len, output_len = WORKLOADS["W2"]
    vocab = int(read_hf_config(model)["vocab_size"])
    workload = bench.random_workload(num, input_len, output_len, vocab, seed=0)
    lines = ["### W2: Llama-3.1-8B, 1000 requests\n",
             "| weights / KV cache | wall s | output tok/s | req/s |",
             "|---|---:|---:|---:|"]  # fmt: skip
    variants = {"bf16 / bf16": {}, "fp8 / fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}
    for label, extra in variants.items():
        settings = engine_args(model, max_num_seqs=1024, max_num_batched_tokens=16384, **extra)
        result = bench.run_pagedserve(workload, settings)
        free_gpu()
        lines.append(f"| {label} | {result.elapsed_s:.2f} | {result.output_tok_s:,.0f} | "
                     f"{result.req_s:.2f} |")  # fmt: skip
        print(lines[-1], flush=True)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="+", default=["kernels", "W3", "W2"])
    parser.add_argument("--repeat", type=int, default=2, help="W3: engines a variant")
    args = parser.parse_args()
    command = " ".join(["python scripts/gpu/bench_quant.py", *sys.argv[1:]])
    sections = [f"# Quantization on {torch.cuda.get_device_name()} ({datetime.date.today()})\n",
                f"command: `{command}`\n"]  # fmt: skip
    steps = {"kernels": lambda: kernels(Timer(torch.device("cuda"))), "W3": lambda: w3(args),
             "W2": lambda: w2(args)}  # fmt: skip
    for name in args.only:
        try:
            sections += steps[name]()
        except Exception:
            traceback.print_exc()
            sections.append(f"### {name}: FAILED (see log)")
        sections.append("")
        Path(args.out).write_text("\n".join(sections))
    print("\n".join(sections), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
