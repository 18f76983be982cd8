"""The Triton prefill attention kernel's launch configurations (PrefillTiles) against each other
and against FlashInfer's BatchPrefillWithPagedKVCacheWrapper, on long-prompt shapes.

1. Correctness first: every variant (and FlashInfer) runs one mixed check step per head shape
   (fresh prompts, chunks after a cached prefix, a decode; lengths 1..1000) and is compared
   with the float32 pure-torch reference (attention_ref); a variant off by more than 3e-2 is
   reported FAIL and not timed. Nothing aborts the sweep.
2. Timing: each variant on each shape (requests x prompt length, bf16, head_dim 128, block
   size 16, fresh prompts, causal), median of triton's do_bench (eager: launches included).
   TFLOP/s counts the visible (causal) query-key pairs exactly:
   flops = 4 * sum_b (q_b * ctx_b + q_b * (q_b + 1) / 2) * num_heads * head_dim
   (QK^T and PV, 2 flops a multiply-add; = 2*2*q*(kv - q/2)*heads*d up to the diagonal).
3. The table last, and per shape the winner; then the variant with the best geomean over
   shapes (what the default `prefill_tiles` should be).

    bash scripts/gpu/run.sh install && \\
    PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu/sweep_prefill.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from pagedserve.kernels import attention_ref
from pagedserve.kernels import triton_attention as ta
from pagedserve.kernels.attention_metadata import AttentionMetadata, build_attention_metadata

BLOCK_SIZE = 16
HEAD_DIM = 128
ATOL = 3e-2
DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
# (name, num_heads, num_kv_heads)
HEADS = [("llama-8b 32/8", 32, 8), ("qwen3-0.6b 16/8", 16, 8)]
# variant name -> (tiles, longest-first order)
VARIANTS: dict[str, tuple[ta.PrefillTiles, bool]] = {
    "128x128 w8 s2": (ta.PrefillTiles(128, 128, 8, 2), True),
    "128x128 w8 s2 batch-order": (ta.PrefillTiles(128, 128, 8, 2), False),
    "128x128 w8 s3": (ta.PrefillTiles(128, 128, 8, 3), True),
    "128x64 w8 s3": (ta.PrefillTiles(128, 64, 8, 3), True),
    "128x64 w8 s2": (ta.PrefillTiles(128, 64, 8, 2), True),
    "128x64 w4 s3 (old config)": (ta.PrefillTiles(128, 64, 4, 3), True),
    "128x32 w8 s3": (ta.PrefillTiles(128, 32, 8, 3), True),
    "64x64 w4 s3": (ta.PrefillTiles(64, 64, 4, 3), True),
    "64x128 w4 s2": (ta.PrefillTiles(64, 128, 4, 2), True),
    "256x64 w8 s2": (ta.PrefillTiles(256, 64, 8, 2), True),
}
QUICK_VARIANTS = ["128x128 w8 s2", "128x128 w8 s2 batch-order", "128x64 w8 s3", "64x64 w4 s3"]
CHECK_CASES = [(0, 1000), (500, 77), (0, 300), (130, 1), (1000, 260), (0, 2)]


@dataclass
class Step:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    metadata: AttentionMetadata
    flops: float


def make_step(cases: list[tuple[int, int]], num_heads: int, num_kv_heads: int, seed: int) -> Step:
    """Requests (cached tokens, new tokens) over shuffled pages of a bf16 cache."""
    gen = torch.Generator().manual_seed(seed)
    pages = [triton.cdiv(ctx + new, BLOCK_SIZE) for ctx, new in cases]
    num_blocks = sum(pages) + 1
    pool = torch.randperm(num_blocks, generator=gen)
    width = max(pages)
    tables = torch.zeros(len(cases), width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        tables[b, :n] = pool[used : used + n]
        used += n
    slots = [
        int(tables[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
        for b, (ctx, new) in enumerate(cases)
        for p in range(ctx, ctx + new)
    ]
    metadata = build_attention_metadata(
        torch.tensor([new for _, new in cases]),
        torch.tensor([ctx + new for ctx, new in cases]),
        tables,
        torch.tensor(slots),
        BLOCK_SIZE,
        DEVICE,
    )
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    k_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE)
    q = torch.randn(len(slots), num_heads, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    pairs = sum(new * ctx + new * (new + 1) / 2 for ctx, new in cases)
    return Step(q, k_cache, v_cache, metadata, 4 * pairs * num_heads * HEAD_DIM)


def shapes(quick: bool) -> list[tuple[str, str, int, int, list[tuple[int, int]]]]:
    """(shape name, heads name, num_heads, num_kv_heads, cases)."""
    gen = torch.Generator().manual_seed(0)
    long = [(0, int(n)) for n in torch.randint(7000, 8001, (32,), generator=gen)]
    sizes = [("8x1024", [(0, 1024)] * 8), ("32x7-8k", long)]
    if not quick:
        sizes.insert(0, ("1x128", [(0, 128)]))
    heads = HEADS[:1] if quick else HEADS
    return [(s, h, nh, nkv, cases) for s, cases in sizes for h, nh, nkv in heads]


def triton_fn(
    step: Step, tiles: ta.PrefillTiles | None, ordered: bool
) -> Callable[[], torch.Tensor]:
    """This engine's prefill kernel on `step`; tiles None: the kernel's own (the engine's)."""
    md = step.metadata
    out = torch.empty_like(step.q)
    order = md.longest_first if ordered else None

    def run() -> torch.Tensor:
        return ta.paged_attention(
            step.q, step.k_cache, step.v_cache, md.block_tables, md.seq_lens,
            md.query_start_loc, md.max_query_len, HEAD_DIM**-0.5, out,
            max_seq_len=md.max_seq_len, prefill_tiles=tiles, longest_first=order,
        )  # fmt: skip

    return run


def flashinfer_fn(step: Step, flashinfer) -> Callable[[], torch.Tensor]:  # type: ignore[no-untyped-def]
    """FlashInfer's paged prefill (NHD layout = our cache layout) planned for the step."""
    md = step.metadata
    seq_lens = md.seq_lens_cpu
    pages = (seq_lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    indptr = torch.zeros(len(pages) + 1, dtype=torch.int32)
    torch.cumsum(pages, 0, out=indptr[1:])
    indices = torch.cat([md.block_tables_cpu[b, : int(n)] for b, n in enumerate(pages)])
    last_len = (seq_lens - 1) % BLOCK_SIZE + 1
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(
        md.query_start_loc, indptr.to(DEVICE), indices.to(DEVICE, torch.int32),
        last_len.to(DEVICE, torch.int32), step.q.shape[1], step.k_cache.shape[2], HEAD_DIM,
        BLOCK_SIZE, causal=True, q_data_type=DTYPE, kv_data_type=DTYPE,
    )  # fmt: skip
    return lambda: wrapper.run(step.q, (step.k_cache, step.v_cache))


def check(fn: Callable[[], torch.Tensor], step: Step, expected: torch.Tensor) -> str:
    """'ok (max err)' or 'FAIL ...'; never raises."""
    try:
        error = (fn().float() - expected).abs().max().item()
    except Exception as exc:  # noqa: BLE001 - a failing variant is reported, not fatal
        traceback.print_exc()
        return f"FAIL ({type(exc).__name__}: {str(exc)[:80]})"
    return f"ok ({error:.1e})" if error <= ATOL else f"FAIL (max err {error:.1e})"


def compiled_registers() -> dict[tuple, tuple[int, int]]:
    """(n_regs, n_spills) of every compiled _prefill_kernel, by its cache key ({} if unknown)."""
    found = {}
    try:
        for caches in ta._prefill_kernel.device_caches.values():
            for key, kernel in caches[0].items():
                kernel._init_handles()
                found[key] = (kernel.n_regs, kernel.n_spills)
    except Exception:  # noqa: BLE001 - Triton internals: report '?' instead
        return {}
    return found


def time_ms(fn: Callable[[], torch.Tensor]) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer shapes and variants")
    parser.add_argument("--out", default=None, help="write the markdown here")
    args = parser.parse_args()
    started = time.monotonic()
    names = QUICK_VARIANTS if args.quick else list(VARIANTS)
    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001 - any import failure: measure without it
        print(f"flashinfer: unavailable ({type(exc).__name__}: {exc})")
        flashinfer = None
    lines = [
        f"# Triton prefill sweep ({datetime.date.today()}, {torch.cuda.get_device_name()}, "
        f"triton {triton.__version__})\n",
        "bf16, head_dim 128, block size 16, causal fresh prompts; TFLOP/s = 4 * visible "
        "query-key pairs * heads * head_dim / time (do_bench median, eager).\n",
    ]

    print("## correctness (mixed check step vs float32 reference)", flush=True)
    failed: set[str] = set()
    spills: dict[str, str] = {}
    for heads_name, num_heads, num_kv_heads in HEADS:
        step = make_step(CHECK_CASES, num_heads, num_kv_heads, seed=num_heads)
        expected = attention_ref.paged_attention(
            step.q.float(), step.k_cache.float(), step.v_cache.float(), step.metadata,
            HEAD_DIM**-0.5,
        ).float()  # fmt: skip
        for name in names:
            before = compiled_registers()
            verdict = check(triton_fn(step, *VARIANTS[name]), step, expected)
            new = [v for k, v in compiled_registers().items() if k not in before]
            if new:
                spills[name] = f"{max(r for r, _ in new)} regs, {max(s for _, s in new)} spills"
            failed |= {name} if verdict.startswith("FAIL") else set()
            print(f"{heads_name:16} {name:26} {verdict} {spills.get(name, '')}", flush=True)
        if flashinfer is not None:
            verdict = check(lambda s=step: flashinfer_fn(s, flashinfer)(), step, expected)
            failed |= {"flashinfer"} if verdict.startswith("FAIL") else set()
            print(f"{heads_name:16} {'flashinfer':26} {verdict}", flush=True)

    columns = [n for n in names if n not in failed]
    if flashinfer is not None and "flashinfer" not in failed:
        columns.append("flashinfer")
    table = [
        "| shape | heads | TFLOP | " + " | ".join(columns) + " | best Triton |",
        "|---|---|---:|" + "---:|" * len(columns) + "---|",
    ]
    results: dict[str, list[float]] = {n: [] for n in columns}
    print("\n## timing (TFLOP/s)", flush=True)
    for shape_name, heads_name, num_heads, num_kv_heads, cases in shapes(args.quick):
        step = make_step(cases, num_heads, num_kv_heads, seed=len(cases))
        cells = []
        for name in columns:
            try:
                fn = (
                    flashinfer_fn(step, flashinfer)
                    if name == "flashinfer"
                    else triton_fn(step, *VARIANTS[name])
                )
                tflops = step.flops / time_ms(fn) / 1e9
            except Exception as exc:  # noqa: BLE001 - report, continue
                print(f"{shape_name} {heads_name} {name}: FAIL {type(exc).__name__}: {exc}")
                tflops = float("nan")
            results[name].append(tflops)
            cells.append(tflops)
            print(f"{shape_name:8} {heads_name:16} {name:26} {tflops:7.1f}", flush=True)
        ours = {n: t for n, t in zip(columns, cells) if n != "flashinfer" and not math.isnan(t)}
        best = max(ours, key=ours.__getitem__) if ours else "-"
        table.append(
            f"| {shape_name} | {heads_name} | {step.flops / 1e12:.2f} | "
            + " | ".join(f"{t:.1f}" if t < 10 else f"{t:.0f}" for t in cells)
            + f" | {best} |"
        )
        del step
        torch.cuda.empty_cache()

    geomeans = {
        n: math.exp(sum(map(math.log, r)) / len(r))
        for n, r in results.items()
        if r and not any(math.isnan(t) or t <= 0 for t in r)
    }
    table.append(
        "| geomean | | | "
        + " | ".join(f"{geomeans[n]:.0f}" if n in geomeans else "-" for n in columns)
        + " | |"
    )
    ours = {n: g for n, g in geomeans.items() if n != "flashinfer"}
    winner = max(ours, key=ours.__getitem__) if ours else "none"
    lines += table
    lines.append(f"\nbest Triton variant by geomean: **{winner}** {VARIANTS.get(winner)}")
    lines.append(f"registers (from the check step's compiles): {spills or 'unknown'}")
    lines.append(f"failed correctness: {sorted(failed) or 'none'}")
    lines.append(f"sweep time: {time.monotonic() - started:.0f} s")
    print("\n" + "\n".join(lines), flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
