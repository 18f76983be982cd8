"""Compile GPU-only Triton kernels for a GPU target on a machine without one (Triton's compiler
and ptxas run on the CPU; nothing is launched): the launches their launchers make, recorded from
the real launcher code and compiled with triton.compile. Prints one line a launch and exits 1 on
any failure.

  lora  add_lora_delta (pagedserve/kernels/triton_lora.py): shrink and expand for a small step
        (K split over programs) and a large one, on Qwen3-0.6B's projection shapes.
  moe   the router and fused_experts (pagedserve/kernels/triton_moe.py: route, the align and
        the two grouped GEMMs, and the GEMMs of fp8 and of int4 experts, the int4 ones in
        groups of 128 inputs as Qwen3-30B-A3B-GPTQ-Int4's) on Qwen3-30B-A3B's shapes.
  rotary qk_norm_rotary_ (pagedserve/kernels/triton_ops.py) with the KV cache write and
        dependent launch, as the engine runs it: Qwen3-0.6B's (q/k norm), Phi-4-mini's
        (partial rotary) and the two together.
  attention  paged_attention (pagedserve/kernels/triton_attention.py) with a layer's sliding
        window and logit softcap (Gemma's options): the decode and reduce kernels with each
        and both, and a step with a prefill chunk with both (64 x 64 prefill tiles), on
        Llama-3.1-8B's heads.

Each for bf16 and fp32 and each --tokens count.

    python scripts/compile_triton_kernels.py [--arch 90] [--tokens 1 256] [--kernels lora moe
        rotary]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedserve.kernels import triton_attention, triton_lora, triton_moe, triton_ops  # noqa: E402
from pagedserve.kernels.attention_metadata import build_attention_metadata  # noqa: E402
from pagedserve.kernels.moe_ref import ClampedSwiGLU, Int4Experts, Mxfp4Experts  # noqa: E402

LORA_SHAPES = {
    "qkv": (1024, [2048, 1024, 1024]),
    "gate_up": (1024, [3072, 3072]),
    "down": (3072, [1024]),
}
# (experts, top k, hidden, expert intermediate size); the sizes are the kernels' run-time
# arguments, so one shape covers every compiled variant
MOE_SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768)}
INT4_GROUP = 128
# (q heads, kv heads, head_dim, rotary dims, q/k norm)
ROTARY_SHAPES = {
    "qwen3-0.6b": (16, 8, 128, 128, True),
    "phi-4-mini": (24, 8, 128, 96, False),
    "partial+norm": (16, 8, 128, 64, True),
}
_TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64",
          torch.float8_e4m3fn: "fp8e4nv", torch.uint8: "u8"}  # fmt: skip
Launch = tuple[triton.runtime.JITFunction, tuple, dict]


class _Recorder:
    """Stands in for a kernel: kernel[grid](*args, **kwargs) records the launch."""

    def __init__(self, fn: triton.runtime.JITFunction) -> None:
        self.fn, self.launches = fn, []

    def __getitem__(self, grid: tuple) -> object:
        def record(*args: object, **kwargs: object) -> None:
            self.launches.append((args, kwargs))

        return record


# constexprs that the launchers set for Triton's CPU interpreter, as a GPU launch sets them
_ON_THE_GPU = {"UPCAST": False, "DECODE_ASM": True}


def recorded(module: object, names: tuple[str, ...], call: Callable[[], object]) -> list[Launch]:
    """(kernel, args, kwargs) of every launch of module's kernels `names` that call() makes,
    with the constexprs a GPU launch sets (_ON_THE_GPU)."""
    recorders = {name: _Recorder(getattr(module, name)) for name in names}
    for name, recorder in recorders.items():
        setattr(module, name, recorder)
    try:
        call()
    finally:
        for name, recorder in recorders.items():
            setattr(module, name, recorder.fn)
    return [
        (r.fn, args, kwargs | {k: v for k, v in _ON_THE_GPU.items() if k in kwargs})
        for r in recorders.values()
        for args, kwargs in r.launches
    ]


def lora_launches(tokens: int, dtype: torch.dtype) -> dict[str, list[Launch]]:
    """add_lora_delta's two launches for each projection shape."""
    out = {}
    for shape, (k, sizes) in LORA_SHAPES.items():
        x, y = torch.zeros(tokens, k, dtype=dtype), torch.zeros(tokens, sum(sizes), dtype=dtype)
        a = torch.zeros(4, len(sizes), 16, k, dtype=dtype)
        b = torch.zeros(4, sum(sizes), 16, dtype=dtype)
        order, starts = torch.zeros(tokens, dtype=torch.int32), torch.zeros(5, dtype=torch.int32)
        call = functools.partial(triton_lora.add_lora_delta, x, y, a, b, order, starts, sizes)
        out[shape] = recorded(triton_lora, ("_shrink_kernel", "_expand_kernel"), call)
    return out


def moe_launches(tokens: int, dtype: torch.dtype) -> dict[str, list[Launch]]:
    """The router's launch and fused_experts' three (the align, the two GEMMs) for each expert
    shape; for bf16 also those of its fp8, int4 and MXFP4 (GPT-OSS's) experts."""
    out = {}
    for shape, (experts, top_k, hidden, inter) in MOE_SHAPES.items():
        x = torch.zeros(tokens, hidden, dtype=dtype)
        w13 = torch.zeros(experts, 2 * inter, hidden, dtype=dtype)
        w2 = torch.zeros(experts, hidden, inter, dtype=dtype)
        weights = torch.full((tokens, top_k), 1.0 / top_k)
        ids = torch.arange(tokens * top_k).view(tokens, top_k) % experts

        logits = torch.zeros(tokens, experts, dtype=dtype)
        out[shape] = recorded(
            triton_moe, ("_route_kernel",), functools.partial(triton_moe.route, logits, top_k, True)
        ) + recorded(
            triton_moe, ("_align_kernel", "_expert_gemm_kernel"),
            functools.partial(triton_moe.fused_experts, x, w13, w2, weights, ids),
        )  # fmt: skip
        if dtype == torch.bfloat16:  # fp8 (W8A16) and int4 (W4A16) experts, bf16 activations
            fp8 = (w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn))
            scales = (torch.ones(experts, 2 * inter), torch.ones(experts, hidden))
            out[f"{shape} fp8"] = recorded(
                triton_moe, ("_align_kernel", "_expert_gemm_kernel"),
                functools.partial(triton_moe.fused_experts, x, *fp8, weights, ids, scales=scales),
            )  # fmt: skip
            int4 = (int4_experts(w13, dtype), int4_experts(w2, dtype))
            out[f"{shape} int4"] = recorded(
                triton_moe, ("_align_kernel", "_expert_gemm_kernel"),
                functools.partial(triton_moe.fused_experts, x, *int4, weights, ids),
            )  # fmt: skip
            mxfp4 = (mxfp4_experts(w13), mxfp4_experts(w2))  # GPT-OSS's: biases, clamp
            biases = (w13[:, :, 0].contiguous(), w2[:, :, 0].contiguous())
            gpt_oss = {"biases": biases, "clamped": ClampedSwiGLU(1.702, 7.0)}
            out[f"{shape} mxfp4"] = recorded(
                triton_moe, ("_align_kernel", "_expert_gemm_kernel"),
                functools.partial(triton_moe.fused_experts, x, *mxfp4, weights, ids, **gpt_oss),
            )  # fmt: skip
    return out


def mxfp4_experts(w: torch.Tensor) -> Mxfp4Experts:
    """Zero MXFP4 codes and unit scales in w's shape [E, N, K]."""
    experts, n, k = w.shape
    codes = torch.zeros(experts, n, k // 2, dtype=torch.uint8)
    return Mxfp4Experts(codes, torch.full((experts, n, k // 32), 127, dtype=torch.uint8))


def int4_experts(w: torch.Tensor, dtype: torch.dtype) -> Int4Experts:
    """Zero int4 codes in w's shape [E, N, K], groups of INT4_GROUP, scales and zeros in dtype."""
    experts, n, k = w.shape
    groups = torch.zeros(experts, n, k // INT4_GROUP, dtype=dtype)
    codes = torch.zeros(experts, n, k // 8, dtype=torch.int32)
    return Int4Experts(codes, groups, groups.clone(), INT4_GROUP)


def rotary_launches(tokens: int, dtype: torch.dtype) -> dict[str, list[Launch]]:
    """qk_norm_rotary_'s launch on a fused qkv buffer, writing the paged KV cache, for each
    rotary shape."""
    out = {}
    for shape, (heads, kv_heads, head_dim, rotary_dim, norm) in ROTARY_SHAPES.items():
        qk_width = (heads + kv_heads) * head_dim
        qkv = torch.zeros(tokens, qk_width + kv_heads * head_dim, dtype=dtype)
        qk = qkv[:, :qk_width].view(tokens, heads + kv_heads, head_dim)
        v = qkv[:, qk_width:].view(tokens, kv_heads, head_dim)
        cache = torch.zeros(4096, rotary_dim // 2, dtype=dtype)
        weights = (torch.ones(head_dim, dtype=dtype),) * 2 if norm else (None, None)
        kv_caches = (torch.zeros(64, 16, kv_heads, head_dim, dtype=dtype) for _ in "kv")
        slots = torch.zeros(tokens, dtype=torch.int64)
        write = triton_ops.KVWrite(v, *kv_caches, slots)
        call = functools.partial(
            triton_ops.qk_norm_rotary_, qk, slots, cache, cache, *weights, 1e-6,
            num_q_heads=heads, kv_write=write, rotary_dim=rotary_dim, dependent_launch=True,
        )  # fmt: skip
        out[shape] = recorded(triton_ops, ("_qk_norm_rotary_kernel",), call)
    return out


# (name, paged_attention's keyword options)
ATTENTION_OPTIONS = [
    ("window", {"window": 4096}),
    ("softcap", {"softcap": 50.0}),
    ("window+softcap", {"window": 4096, "softcap": 50.0}),
    ("window+sinks", {"window": 4096, "sinks": torch.zeros(32)}),  # GPT-OSS's
]
# prefill tiles of 64 rows x 64 keys: the engine's 128 x 128 compile in about a minute each
# here (they compiled: scripts/results/session30.md)
COMPILE_PREFILL_TILES = triton_attention.PrefillTiles(64, 64, 4, 2)


def attention_launches(tokens: int, dtype: torch.dtype) -> dict[str, list[Launch]]:
    """paged_attention's launches over contexts of up to 8k keys on Llama-3.1-8B's heads: a
    decode step (1 token) with each option set, or a step with a prefill chunk beside decodes
    with both options; the launches as on a GPU (the tensor-core path for bf16, not the
    interpreter's upcast)."""
    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    cases = [(100, 1), (8000, 1)] + ([(500, tokens)] if tokens > 1 else [])
    query_lens = torch.tensor([new for _, new in cases])
    seq_lens = torch.tensor([ctx + new for ctx, new in cases])
    tables = torch.zeros(len(cases), 512, dtype=torch.int32)
    slots = torch.zeros(int(query_lens.sum()), dtype=torch.int64)
    cpu = torch.device("cpu")
    md = build_attention_metadata(query_lens, seq_lens, tables, slots, block_size, cpu)
    q = torch.zeros(int(query_lens.sum()), heads, head_dim, dtype=dtype)
    cache = torch.zeros(64, block_size, kv_heads, head_dim, dtype=dtype)
    names = ("_prefill_kernel", "_decode_kernel", "_decode_reduce_kernel")
    out = {}
    for label, options in ATTENTION_OPTIONS if tokens == 1 else ATTENTION_OPTIONS[-1:]:
        call = functools.partial(
            triton_attention.paged_attention, q, cache, cache, md.block_tables, md.seq_lens,
            md.query_start_loc, md.max_query_len, 0.1, max_seq_len=md.max_seq_len,
            num_splits=4, prefill_tiles=COMPILE_PREFILL_TILES, longest_first=md.longest_first,
            **options,
        )  # fmt: skip
        out[label] = recorded(triton_attention, names, call)
    return out


KERNELS = {
    "attention": attention_launches,
    "lora": lora_launches,
    "moe": moe_launches,
    "rotary": rotary_launches,
}


def compile_launch(fn: triton.runtime.JITFunction, args: tuple, kwargs: dict, arch: int) -> None:
    signature, constexprs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if i < len(args):
            value = args[i]
            if torch.is_tensor(value):
                signature[name] = f"*{_TYPES[value.dtype]}"
            else:
                signature[name] = "fp32" if isinstance(value, float) else "i32"
        else:
            signature[name] = "constexpr"
            constexprs[(i,)] = kwargs[name]
    source = ASTSource(fn, signature=signature, constexprs=constexprs)
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--kernels", nargs="+", default=sorted(KERNELS), choices=sorted(KERNELS))
    args = parser.parse_args()
    failed = 0
    for family in args.kernels:
        for tokens in args.tokens:
            for dtype in (torch.bfloat16, torch.float32):
                for shape, launches in KERNELS[family](tokens, dtype).items():
                    for fn, launch_args, kwargs in launches:
                        started = time.perf_counter()
                        label = f"{fn.__name__} {shape} tokens={tokens} {_TYPES[dtype]}"
                        try:
                            compile_launch(fn, launch_args, kwargs, args.arch)
                        except Exception as exc:  # reported, the rest go on
                            failed += 1
                            print(
                                f"FAILED {label}: {type(exc).__name__}: {exc} {exc.__cause__!r}"[
                                    -3000:
                                ],
                                flush=True,
                            )
                            continue
                        print(f"ok {label} ({time.perf_counter() - started:.1f} s)", flush=True)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
