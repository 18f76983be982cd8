"""MXFP4 experts (GPT-OSS's) on the GPU: the expert GEMMs' bit-operation decode against the
reference, then their time against the same experts in bf16, on gpt-oss-20b's expert shapes
(32 experts, top 4, hidden 2,880, intermediate 2,880). One markdown report:

    python scripts/gpu/check_mxfp4.py --out FILE

decode   x = I through the expert GEMM (each pair one column k, routing weight 1): out[k, n]
         must equal the reference's W[e, n, k] bit for bit, all 16 codes and scales 2^-124 to
         2^125, on the decode step's tiles (16 pairs) and a prefill's (64).
experts  fused_experts with MXFP4 weights against the reference on their dequantized weights
         (fp32), bf16 activations, 1 to 512 tokens; µs a call (a CUDA graph of 20 calls) for
         MXFP4 and for the same weights in bf16, and the expert bytes each reads a call.
tiles    MXFP4 at 1 token over BLOCK_N x BLOCK_K x 4 / 8 warps, at 64 tokens over half of
         them (the module's _tiles replaced for the sweep): µs a call.
compile  registers and spilled bytes of the expert GEMM's kernels (gated and not) for bf16
         and MXFP4 weights, as this GPU's Triton compiles them.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_moe import graph_seconds  # noqa: E402

from pagedserve.kernels import moe_ref, quant_ref  # noqa: E402
from pagedserve.kernels import triton_moe as tm  # noqa: E402

DEVICE = torch.device("cuda")
EXPERTS, TOP_K, HIDDEN, INTER = 32, 4, 2880, 2880
SWEEP = ((32, 128), (32, 256), (64, 128), (64, 256), (128, 128), (128, 256))  # BLOCK_N, BLOCK_K


def random_mxfp4(experts: int, n: int, k: int, seed: int, scales: tuple[int, int]):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (experts, n, k // 2), generator=gen, dtype=torch.uint8)
    s = torch.randint(*scales, (experts, n, k // 32), generator=gen, dtype=torch.uint8)
    return moe_ref.Mxfp4Experts(codes.to(DEVICE), s.to(DEVICE))


def decode() -> list[str]:
    lines = ["| experts (pairs a tile) | expert | bit-equal to the reference |", "|---|---:|---|"]
    n, k = 256, 512
    for experts in (2, 64):  # 512 pairs on one expert: tiles of 64 pairs, then of 16
        w = random_mxfp4(experts, n, k, seed=experts, scales=(3, 253))
        dense = quant_ref.dequantize_mxfp4(w.codes, w.scales, torch.float32)
        tiles = tm._tiles(k, experts)
        for expert in (0, experts - 1):
            ids = torch.full((k, 1), expert, dtype=torch.int32, device=DEVICE)
            blocks = tm.align_by_expert(ids, experts, tiles.block_m)
            out = torch.empty(k, n, device=DEVICE)
            eye = torch.eye(k, device=DEVICE, dtype=torch.bfloat16)
            ones = torch.ones(k, device=DEVICE)
            tm._expert_gemm(eye, tm._operands(w, None), out, blocks, ones, 1, tiles)
            equal = torch.equal(out, dense[expert].T)
            wrong = int((out != dense[expert].T).sum())
            verdict = "yes" if equal else f"**NO** ({wrong} values differ)"
            lines.append(f"| {experts} ({tiles.block_m}) | {expert} | {verdict} |")
            print(lines[-1], flush=True)
    return lines


def routing(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(t)])
    weights = torch.rand(t, TOP_K, generator=gen)
    return (weights / weights.sum(-1, keepdim=True)).to(DEVICE), ids.to(DEVICE)


def experts() -> list[str]:
    lines = [
        "| tokens | MXFP4 max error / max output | MXFP4 µs | bf16 µs | MXFP4 / bf16 "
        "| MXFP4 GB/s | bf16 GB/s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    w13 = random_mxfp4(EXPERTS, 2 * INTER, HIDDEN, seed=1, scales=(118, 124))
    w2 = random_mxfp4(EXPERTS, HIDDEN, INTER, seed=2, scales=(118, 124))
    dense = [quant_ref.dequantize_mxfp4(w.codes, w.scales, torch.float32) for w in (w13, w2)]
    bf16 = [d.to(torch.bfloat16) for d in dense]  # exact: the same weights
    gen = torch.Generator().manual_seed(3)
    b13 = (torch.randn(EXPERTS, 2 * INTER, generator=gen) * 0.1).to(DEVICE)
    b2 = (torch.randn(EXPERTS, HIDDEN, generator=gen) * 0.1).to(DEVICE)
    clamped = moe_ref.ClampedSwiGLU(alpha=1.702, limit=7.0)
    extra = {"biases": (b13.bfloat16(), b2.bfloat16()), "clamped": clamped}
    for t in (1, 8, 64, 512):
        x = (torch.randn(t, HIDDEN, generator=gen) * 0.5).to(DEVICE, torch.bfloat16)
        weights, ids = routing(t, seed=t)
        got = tm.fused_experts(x, w13, w2, weights, ids, **extra)
        want = moe_ref.fused_experts(
            x.float(), *dense, weights, ids, biases=(b13, b2), clamped=clamped
        )
        error = float((got.float() - want).abs().max()) / float(want.abs().max())
        mx = graph_seconds(functools.partial(tm.fused_experts, x, w13, w2, weights, ids, **extra))
        bf = graph_seconds(functools.partial(tm.fused_experts, x, *bf16, weights, ids, **extra))
        hit = len(torch.unique(ids))
        params = hit * 3 * INTER * HIDDEN
        ok = "ok" if error < 2e-2 else "**FAIL**"
        lines.append(
            f"| {t} | {error:.1e} {ok} | {mx * 1e6:.1f} | {bf * 1e6:.1f} | {mx / bf:.2f} "
            f"| {params * (0.5 + 1 / 32) / mx / 1e9:,.0f} | {params * 2 / bf / 1e9:,.0f} |"
        )
        print(lines[-1], flush=True)
    return lines


def tiles() -> list[str]:
    lines = ["| tokens | BLOCK_N | BLOCK_K | warps | MXFP4 µs |", "|---:|---:|---:|---:|---:|"]
    w13 = random_mxfp4(EXPERTS, 2 * INTER, HIDDEN, seed=1, scales=(118, 124))
    w2 = random_mxfp4(EXPERTS, HIDDEN, INTER, seed=2, scales=(118, 124))
    planned = tm._tiles
    try:
        for t, sizes in ((1, SWEEP), (64, SWEEP[1::2])):
            x = torch.randn(t, HIDDEN).to(DEVICE, torch.bfloat16)
            weights, ids = routing(t, seed=t)
            block_m = planned(t * TOP_K, EXPERTS).block_m
            for block_n, block_k in sizes:
                for warps in (4, 8):
                    config = tm._Tiles(block_m, block_n, block_k, warps)
                    tm._tiles = lambda *_, config=config: config
                    try:
                        call = functools.partial(tm.fused_experts, x, w13, w2, weights, ids)
                        cell = f"{graph_seconds(call) * 1e6:.1f}"
                    except Exception as exc:  # a config the compiler refuses
                        cell = f"failed: {type(exc).__name__}"
                    finally:
                        tm._tiles = planned
                    lines.append(f"| {t} | {block_n} | {block_k} | {warps} | {cell} |")
                    print(lines[-1], flush=True)
    finally:
        tm._tiles = planned
    return lines


def compiled() -> list[str]:
    """Registers and spills of the expert GEMM's kernels, compiled from the launches that
    scripts/compile_triton_kernels.py records (a decode step's, bf16 activations)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import triton
    from compile_triton_kernels import _TYPES, moe_launches
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    lines = ["| weights | gated | registers | spilled bytes |", "|---|---|---:|---:|"]
    launches = moe_launches(1, torch.bfloat16)
    target = GPUTarget("cuda", 90, 32)
    for label in ("qwen3-30b-a3b", "qwen3-30b-a3b mxfp4"):
        for fn, args, kwargs in launches[label]:
            if fn.__name__ != "_expert_gemm_kernel":
                continue
            signature, constexprs = {}, {}
            for i, name in enumerate(fn.arg_names):
                if i < len(args):
                    value = args[i]
                    signature[name] = (
                        f"*{_TYPES[value.dtype]}" if torch.is_tensor(value)
                        else "fp32" if isinstance(value, float) else "i32"
                    )  # fmt: skip
                else:
                    signature[name], constexprs[(i,)] = "constexpr", kwargs[name]
            source = ASTSource(fn, signature=signature, constexprs=constexprs)
            kernel = triton.compile(
                source, target=target, options={"num_warps": kwargs["num_warps"]}
            )
            kernel._init_handles()
            lines.append(f"| {kwargs['WEIGHTS']} | {kwargs['GATED']} | {kernel.n_regs} "
                         f"| {kernel.n_spills} |")  # fmt: skip
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="+", default=["decode", "experts", "tiles", "compile"])
    args = parser.parse_args()
    report = [f"# MXFP4 experts on {torch.cuda.get_device_name()}, "
              f"{datetime.datetime.now():%Y-%m-%d %H:%M}"]  # fmt: skip
    parts = {"decode": decode, "experts": experts, "tiles": tiles, "compile": compiled}
    for title, run in parts.items():
        if title in args.only:
            report += [f"\n## {title}\n", *run()]
            Path(args.out).write_text("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
