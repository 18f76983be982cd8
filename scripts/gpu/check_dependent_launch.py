#!/usr/bin/env python3
"""Every kernel the engine launches as a programmatic dependent (EngineConfig.dependent_launch)
gives bit for bit the outputs of its plain launch: alone (eager, synchronized before and after:
no overlap possible, so a difference is the code's), and in the decode chain of Llama-3.1-8B
layers (RMSNorm, qkv, q/k rotary with the KV write, CUDA decode attention, o_proj, add +
RMSNorm, gate_up, SiLU-and-mul, down; 300 cached keys; batch 1 with the single-row GEMVs, batch
8 with cuBLAS between the PDL kernels), eager and replayed from a CUDA graph, where a kernel
that read its inputs too early would differ.

    python3 scripts/gpu/check_dependent_launch.py [--layers 8] [--replays 20]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pagedserve.kernels import cuda_attention, cuda_quant, quant_ref, triton_quant  # noqa: E402
from pagedserve.kernels import triton_gemv as tg  # noqa: E402
from pagedserve.kernels import triton_ops as to  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 4096, 32, 8, 128, 14336
CONTEXT, BLOCK = 300, 16
DEVICE = torch.device("cuda")


def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(torch.bfloat16)


class Layer:
    """One decoder layer's weights and its paged KV cache (CONTEXT keys already in it)."""

    def __init__(self, batch: int = 1) -> None:
        self.norms = (rand(HIDDEN), rand(HIDDEN))
        self.qkv = rand((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, scale=0.02)
        self.o = rand(HIDDEN, HEADS * HEAD_DIM, scale=0.02)
        self.gate_up = rand(2 * MLP, HIDDEN, scale=0.02)
        self.down = rand(HIDDEN, MLP, scale=0.02)
        blocks = batch * ((CONTEXT + 1 + BLOCK - 1) // BLOCK)
        self.k_cache = rand(blocks, BLOCK, KV_HEADS, HEAD_DIM)
        self.v_cache = rand(blocks, BLOCK, KV_HEADS, HEAD_DIM)


def _cublas(x: torch.Tensor, w: torch.Tensor, dependent_launch: bool) -> torch.Tensor:
    return torch.nn.functional.linear(x, w)


class Chain:
    """`layers` decoder layers over a batch of requests, each with CONTEXT cached keys; the
    projections as the engine runs them: single-row GEMVs at batch 1, cuBLAS above."""

    def __init__(self, layers: int, batch: int = 1) -> None:
        torch.manual_seed(0)
        self.layers = [Layer(batch) for _ in range(layers)]
        self.x = rand(batch, HIDDEN)
        blocks = self.layers[0].k_cache.shape[0] // batch
        self.block_tables = torch.arange(batch * blocks, device=DEVICE,
                                         dtype=torch.int32).view(batch, blocks)  # fmt: skip
        self.seq_lens = torch.full((batch,), CONTEXT + 1, device=DEVICE, dtype=torch.int32)
        self.positions = torch.full((batch,), CONTEXT, device=DEVICE)
        self.slots = self.block_tables[:, CONTEXT // BLOCK].long() * BLOCK + CONTEXT % BLOCK
        self.linear = tg.skinny_linear if batch == 1 else _cublas
        freqs = torch.arange(4096, device=DEVICE)[:, None] * (
            10000.0 ** (-torch.arange(0, HEAD_DIM, 2, device=DEVICE) / HEAD_DIM))[None]  # fmt: skip
        self.cos, self.sin = freqs.cos().to(torch.bfloat16), freqs.sin().to(torch.bfloat16)

    def forward(self, pdl: bool) -> torch.Tensor:
        h, residual = self.x, None
        for layer in self.layers:
            if residual is None:
                residual, normed = h, to.rms_norm(h, layer.norms[0], 1e-5, dependent_launch=pdl)
            else:
                normed, residual = to.fused_add_rms_norm(h, residual, layer.norms[0], 1e-5,
                                                         dependent_launch=pdl)  # fmt: skip
            qkv = self.linear(normed, layer.qkv, dependent_launch=pdl)
            qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(-1, HEADS + KV_HEADS, HEAD_DIM)
            v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(-1, KV_HEADS, HEAD_DIM)
            write = to.KVWrite(v, layer.k_cache, layer.v_cache, self.slots)
            to.qk_norm_rotary_(qk, self.positions, self.cos, self.sin, num_q_heads=HEADS,
                               kv_write=write, dependent_launch=pdl)  # fmt: skip
            attn = cuda_attention.decode(qk[:, :HEADS], layer.k_cache, layer.v_cache,
                                         self.block_tables, self.seq_lens, HEAD_DIM**-0.5,
                                         4096, dependent_launch=pdl)  # fmt: skip
            o = self.linear(attn.view(len(attn), -1), layer.o, dependent_launch=pdl)
            normed, residual = to.fused_add_rms_norm(o, residual, layer.norms[1], 1e-5,
                                                     dependent_launch=pdl)  # fmt: skip
            act = to.silu_and_mul(self.linear(normed, layer.gate_up, dependent_launch=pdl),
                                  dependent_launch=pdl)  # fmt: skip
            h = self.linear(act, layer.down, dependent_launch=pdl)
        return h + residual


def same(a: torch.Tensor, b: torch.Tensor) -> str:
    if torch.equal(a, b):
        return "identical"
    return f"DIFFER (max abs {(a.float() - b.float()).abs().max().item():.3e})"


def isolated_checks() -> list[tuple[str, str]]:
    """(kernel, result): each launcher with dependent_launch off, then on, synchronized."""
    torch.manual_seed(1)
    x, res, w = rand(1, HIDDEN), rand(1, HIDDEN), rand(HIDDEN)
    weights = {"qkv": rand(6144, HIDDEN, scale=0.02), "down": rand(HIDDEN, MLP, scale=0.02),
               "lm_head": rand(128256, HIDDEN, scale=0.02)}  # fmt: skip
    gu = rand(1, 2 * MLP)
    int4 = quant_ref.quantize_int_weight(weights["qkv"], 4, 128, symmetric=False)
    int4 = quant_ref.IntWeight(int4.qweight, int4.scales.bfloat16(), int4.zeros.bfloat16(),
                               4, 128, None)  # fmt: skip
    wq, w_scale = quant_ref.quantize_fp8_rows(weights["qkv"])
    w_scale = w_scale.squeeze(1).float().contiguous()
    layer = Layer()
    positions, slots = torch.tensor([5], device=DEVICE), torch.tensor([5], device=DEVICE)
    chain = Chain(1)

    def rotary(pdl: bool) -> torch.Tensor:
        qk = base_qk.clone()
        k_cache, v_cache = layer.k_cache.clone(), layer.v_cache.clone()
        write = to.KVWrite(base_v, k_cache, v_cache, slots)
        to.qk_norm_rotary_(qk, positions, chain.cos, chain.sin, num_q_heads=HEADS,
                           kv_write=write, dependent_launch=pdl)  # fmt: skip
        return torch.cat([qk.flatten(), k_cache.flatten(), v_cache.flatten()])

    base_qk, base_v = rand(1, HEADS + KV_HEADS, HEAD_DIM), rand(1, KV_HEADS, HEAD_DIM)
    q = rand(1, HEADS, HEAD_DIM)
    ops: dict[str, Callable[[bool], torch.Tensor]] = {
        "rms_norm": lambda p: to.rms_norm(x, w, 1e-5, dependent_launch=p),
        "fused_add_rms_norm": lambda p: torch.cat(to.fused_add_rms_norm(
            x, res, w, 1e-5, dependent_launch=p)),  # fmt: skip
        "silu_and_mul": lambda p: to.silu_and_mul(gu, dependent_launch=p),
        "qk_norm_rotary_ + KV write": rotary,
        "decode attention (CUDA)": lambda p: cuda_attention.decode(
            q, layer.k_cache, layer.v_cache, chain.block_tables, chain.seq_lens,
            HEAD_DIM**-0.5, 4096, dependent_launch=p),  # fmt: skip
        "int4 GEMV (CUDA)": lambda p: cuda_quant.int_weight_gemv(x, int4, dependent_launch=p),
        "int4 GEMV (Triton)": lambda p: triton_quant.int_weight_gemv(x, int4,
                                                                     dependent_launch=p),
        "fp8 GEMV (Triton)": lambda p: triton_quant.fp8_weight_gemv(x, wq, w_scale,
                                                                    dependent_launch=p),
        "fp8 GEMV (CUDA)": lambda p: cuda_quant.fp8_weight_gemv(x, wq, w_scale,
                                                                dependent_launch=p),
    }  # fmt: skip
    for name, weight in weights.items():
        source = gu[:, :MLP] if name == "down" else x
        ops[f"skinny GEMV {name}"] = lambda p, a=source, b=weight: tg.skinny_linear(
            a, b, dependent_launch=p
        )
    results = []
    for name, op in ops.items():
        off = op(False)
        torch.cuda.synchronize()
        on = op(True)
        torch.cuda.synchronize()
        results.append((name, same(off, on)))
        print(f"{name}: {results[-1][1]}", flush=True)
    return results


def chain_checks(layers: int, replays: int, batch: int) -> list[tuple[str, str]]:
    chain = Chain(layers, batch)
    caches = [(layer.k_cache.clone(), layer.v_cache.clone()) for layer in chain.layers]

    def reset() -> None:
        for layer, (k, v) in zip(chain.layers, caches):
            layer.k_cache.copy_(k)
            layer.v_cache.copy_(v)

    reset()
    reference = chain.forward(False)
    torch.cuda.synchronize()
    results = []
    for pdl in (False, True):
        reset()
        eager = chain.forward(pdl)
        torch.cuda.synchronize()
        results.append((f"chain batch {batch} eager, dependent_launch={pdl}",
                        same(eager, reference)))  # fmt: skip
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain.forward(pdl)
        worst = "identical"
        for _ in range(replays):
            reset()
            graph.replay()
            torch.cuda.synchronize()
            verdict = same(out, reference)
            worst = verdict if verdict != "identical" else worst
        results.append((f"chain batch {batch} graph x{replays}, dependent_launch={pdl}", worst))
        print(*results[-2:], sep="\n", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    with torch.inference_mode():
        results = isolated_checks()
        for batch in (1, 8):
            results += chain_checks(args.layers, args.replays, batch)
    print("\n| check | PDL on vs off |\n|---|---|")
    print("\n".join(f"| {name} | {verdict} |" for name, verdict in results))
    return 0 if all(verdict == "identical" for _, verdict in results) else 1


if __name__ == "__main__":
    sys.exit(main())
