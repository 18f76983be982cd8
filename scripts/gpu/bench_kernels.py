"""Kernels on a GPU: correctness against the torch references at real model shapes, then
timings, one table; attention compares our Triton kernel, our CUDA C++ decode kernel and
FlashInfer on the same inputs.

    python scripts/gpu/bench_kernels.py --out scripts/results/kernels_h200.md [--sweep]
    python scripts/gpu/bench_kernels.py --dry-run        # CPU: arguments, shapes, byte counts

Shapes: Qwen3-0.6B (16 q heads, 8 kv heads, head_dim 128, hidden 1024, MLP 3072, vocab 151936)
and Llama-3.1-8B (32 / 8 / 128, hidden 4096, MLP 14336, vocab 128256), bf16, KV block 16.
Attention: decode 256 x 1024, 1 x 8192 and 64 x 2048 tokens of context; prefill 8 x 1024;
mixed (a 512-token chunk over 1536 cached tokens + 63 decodes at 2048). The small ops at 256
(decode) and 8192 (prefill) tokens; sampling over the vocabulary at batch 256 and 1.
--sweep first checks attention over odd shapes (block sizes 1..256, GQA 1..8, head_dim 16..128).
Linear (`--only gemv`): each model's projections (qkv, o_proj, gate_up, down, lm_head; weights
[N, K] from the shapes above) at decode batches M = 1, 4 and 16, x @ W^T without bias.

Attention rows, one per implementation (`impl`) on the same q, caches and block tables:
  triton      pagedserve.kernels.triton_attention.paged_attention (every shape)
  cuda        pagedserve.kernels.cuda_attention.decode, csrc/paged_attention_decode*.cu built
              with nvcc on import (decode shapes only: that backend runs Triton for prefill);
              "unavailable: why" when it cannot be built or imported
  flashinfer  FlashInfer 0.5's BatchDecodeWithPagedKVCacheWrapper (decode shapes) or
              BatchPrefillWithPagedKVCacheWrapper (causal; prefill, mixed), layout "NHD" on our
              caches; planned and warmed up before timing (JIT compile excluded); a failure is
              printed and leaves the row '-'. Its error is reported, not gated.
Ours are checked against the fp32 torch reference (max abs error < 3e-2); ours/FI is our GPU
time over FlashInfer's. After the table, one line per attention shape says which of Triton and
CUDA is faster.

Linear rows, one per implementation on the same x and W:
  triton      pagedserve.kernels.triton_gemv.skinny_linear (the weight-streaming GEMM the
              layers use for CUDA fp16/bf16 batches of <= 16 rows); its check is the max error
              in units in the last place against F.linear in fp32 rounded once (gated: <= 1),
              then its speedup over cuBLAS, and the launch plan (inner loop, blocks, K splits)
  cublas      F.linear (torch's cuBLAS / cuBLASLt GEMM), the same error (not gated)
GB/s counts the weight bytes only (N * K * 2: x and y are tiny). After the table, one line per
model and batch sums the four per-layer projections and the LM head, ours against cuBLAS.

Columns: GPU time (µs: a CUDA graph of L2 flush + call, minus the flushes; see Timer) and
eager time (triton's do_bench: launch overhead included, as a step without CUDA graphs pays
it); GB/s from the GPU time, counting bytes read + written once (attention: the K and V
context read + q + out, the traffic a perfect kernel needs); TFLOP/s for attention (4 *
head_dim * heads per (query, visible key)); the torch reference's time on the same inputs;
FlashInfer's time and ours / theirs; the check against the reference (max abs error, or
support mismatches for sampling). Exits 1 if a check of ours fails. Runs in a few minutes on
an H200 (more the first time: the nvcc build and FlashInfer's JIT compiles).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import math
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedserve.kernels.attention_metadata import AttentionMetadata

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 16


def build_attention_metadata(*args: object) -> AttentionMetadata:
    """attention_metadata.build_attention_metadata (imported once import_package ran)."""
    from pagedserve.kernels.attention_metadata import build_attention_metadata as build

    return build(*args)  # type: ignore[arg-type]


def import_package() -> None:
    """Make `pagedserve.kernels.*` importable. The kernels need only torch and triton; when the
    package's own imports (msgspec, zmq, ...) are missing on a bare GPU machine, a stub package
    lets the kernel modules import alone."""
    sys.path.insert(0, str(ROOT))
    try:
        import pagedserve  # noqa: F401
    except ImportError as exc:
        print(f"note: `import pagedserve` failed ({exc}); importing the kernels alone")
        for name in [m for m in sys.modules if m == "pagedserve" or m.startswith("pagedserve.")]:
            del sys.modules[name]
        stub = types.ModuleType("pagedserve")
        stub.__path__ = [str(ROOT / "pagedserve")]
        sys.modules["pagedserve"] = stub


def import_kernels() -> tuple[types.ModuleType, ...]:
    """pagedserve.kernels.{attention_ref, triton_attention, triton_ops, triton_sampling}."""
    import_package()
    names = ("attention_ref", "triton_attention", "triton_ops", "triton_sampling")
    return tuple(importlib.import_module(f"pagedserve.kernels.{n}") for n in names)


def load_cuda_attention() -> tuple[types.ModuleType | None, str]:
    """pagedserve.kernels.cuda_attention with its kernel loaded (built by `python -m
    pagedserve.kernels.build`, run.sh's install step), or None and why it cannot be used."""
    import_package()
    start = time.perf_counter()
    try:
        module = importlib.import_module("pagedserve.kernels.cuda_attention")
        module.load_extension()
    except Exception as exc:  # noqa: BLE001 - ImportError (no CUDA, not built) or other
        reason = f"{type(exc).__name__}: {exc}"
        print(f"CUDA decode kernel unavailable: {reason[:4000]}")
        return None, " ".join(reason.split())[:100]
    print(f"CUDA decode kernel loaded in {time.perf_counter() - start:.1f}s")
    return module, ""


def load_flashinfer() -> tuple[types.ModuleType | None, str]:
    try:
        module = importlib.import_module("flashinfer")
    except Exception as exc:  # noqa: BLE001 - optional
        reason = f"not importable ({type(exc).__name__}: {exc})"
        print(f"flashinfer {reason}: no comparison")
        return None, " ".join(reason.split())[:100]
    print(f"flashinfer {getattr(module, '__version__', '?')}")
    return module, ""


@dataclass(frozen=True)
class Model:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int


MODELS = [
    Model("qwen3-0.6b", 16, 8, 128, 1024, 3072, 151936),
    Model("llama-3.1-8b", 32, 8, 128, 4096, 14336, 128256),
]

# name -> requests as (tokens already cached, new tokens this step)
ATTENTION_CASES: dict[str, list[tuple[int, int]]] = {
    "decode 256x1024": [(1023, 1)] * 256,
    "decode 1x8192": [(8191, 1)],
    "decode 64x2048": [(2047, 1)] * 64,
    "prefill 8x1024": [(0, 1024)] * 8,
    "mixed 512@1536+63x2048": [(1536, 512)] + [(2047, 1)] * 63,
}
OP_TOKENS = {"decode": 256, "prefill": 8192}
SAMPLING_BATCHES = (256, 1)
GEMV_BATCHES = (1, 4, 16)


@dataclass
class Row:
    kernel: str
    impl: str
    model: str
    shape: str
    us: float | None = None
    eager_us: float | None = None
    bytes: int = 0
    flops: int = 0
    ref_us: float | None = None
    flashinfer_us: float | None = None
    check: str = "-"
    ok: bool = True
    notes: list[str] = field(default_factory=list)

    def cells(self) -> list[str]:
        gbps = f"{self.bytes / self.us / 1e3:.0f}" if self.us and self.bytes else "-"
        tflops = f"{self.flops / self.us / 1e6:.1f}" if self.us and self.flops else "-"
        ratio = f"{self.us / self.flashinfer_us:.2f}" if self.us and self.flashinfer_us else "-"
        check = self.check if self.ok else f"FAIL {self.check}"
        return [
            self.kernel,
            self.impl,
            self.model,
            self.shape,
            _fmt_us(self.us),
            _fmt_us(self.eager_us),
            gbps,
            tflops,
            _fmt_us(self.ref_us),
            _fmt_us(self.flashinfer_us),
            ratio,
            " ".join(check.replace("|", "/").split()),  # one line, no column breaks
        ]


HEADER = [
    "kernel",
    "impl",
    "model",
    "shape",
    "GPU µs",
    "eager µs",
    "GB/s",
    "TFLOP/s",
    "torch ref µs",
    "FlashInfer µs",
    "ours/FI",
    "check",
]


def _fmt_us(us: float | None) -> str:
    return "-" if us is None else f"{us:.1f}"


def markdown(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- shapes and bytes


def attention_counts(model: Model, requests: list[tuple[int, int]], elt: int) -> tuple[int, int]:
    """(bytes, flops): K+V context read once, q read, out written; 4 * D * H per visible key."""
    context = sum(ctx + new for ctx, new in requests)
    tokens = sum(new for _, new in requests)
    kv_bytes = 2 * context * model.num_kv_heads * model.head_dim * elt
    q_out_bytes = 2 * tokens * model.num_heads * model.head_dim * elt
    visible = sum(new * ctx + new * (new + 1) // 2 for ctx, new in requests)
    return kv_bytes + q_out_bytes, 4 * model.head_dim * model.num_heads * visible


def attention_metadata_cpu(requests: list[tuple[int, int]], gen: torch.Generator) -> dict:
    """Block tables over a shuffled block pool (non-contiguous), lengths and slots, on the CPU."""
    blocks = [math.ceil((ctx + new) / BLOCK_SIZE) for ctx, new in requests]
    num_blocks = sum(blocks) + 1
    pool = torch.randperm(num_blocks, generator=gen)
    width = max(blocks)
    block_tables = torch.zeros(len(requests), width, dtype=torch.int32)
    start = 0
    for r, n in enumerate(blocks):
        block_tables[r, :n] = pool[start : start + n].to(torch.int32)
        start += n
    slots = []
    for r, (ctx, new) in enumerate(requests):
        pos = torch.arange(ctx, ctx + new)
        slots.append(block_tables[r, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    return {
        "num_blocks": num_blocks,
        "block_tables": block_tables,
        "query_lens": torch.tensor([new for _, new in requests]),
        "seq_lens": torch.tensor([ctx + new for ctx, new in requests]),
        "slot_mapping": torch.cat(slots),
    }


# --------------------------------------------------------------------------- timing


class Timer:
    """GPU time from a CUDA graph of REPS x (L2 flush + fn), minus a graph of the flushes
    alone (no launch overhead, cold L2); eager time from triton's do_bench (launches included,
    as a step without CUDA graphs pays them)."""

    REPS = 10

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=device)
        self._flush_us: float | None = None

    def eager(self, fn: Callable[[], object]) -> float:
        import triton.testing

        return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")

    def graph(self, fn: Callable[[], object]) -> float | None:
        """µs per call, or None if fn cannot be captured (a host sync, say)."""
        try:
            fn()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()  # warm the allocator on a side stream, as capture requires
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(self.REPS):
                    self.flush.zero_()
                    fn()
        except Exception as exc:  # noqa: BLE001 - report and fall back to eager
            print(f"  (no CUDA graph: {type(exc).__name__}: {str(exc)[:120]})")
            torch.cuda.synchronize()
            return None
        if self._flush_us is None:
            flush_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(flush_graph):
                for _ in range(self.REPS):
                    self.flush.zero_()
            self._flush_us = self._replay_us(flush_graph)
        us = self._replay_us(graph) - self._flush_us
        del graph
        return max(us, 0.0)

    def _replay_us(self, graph: torch.cuda.CUDAGraph) -> float:
        graph.replay()
        times = []
        for _ in range(7):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return 1e3 * sorted(times)[len(times) // 2] / self.REPS

    def time(self, row: Row, fn: Callable[[], object], reference: Callable[[], object]) -> None:
        """row.us (graph, else eager), row.eager_us, row.ref_us (graph, else eager)."""
        row.eager_us = self.eager(fn)
        row.us = self.graph(fn) or row.eager_us
        row.ref_us = self.graph(reference) or self.eager(reference)


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / (|b| + 1e-3): one bf16 unit in the last place is <= 2^-7 of a value."""
    return float(((a.float() - b.float()).abs() / (b.float().abs() + 1e-3)).max())


def rel_error2(a: tuple, b: tuple) -> float:
    return max(rel_error(a[0], b[0]), rel_error(a[1], b[1]))


# --------------------------------------------------------------------------- attention

ATTENTION_TOLERANCE = 3e-2  # max abs error against the fp32 reference (bf16 inputs)


def is_decode(requests: list[tuple[int, int]]) -> bool:
    return all(new == 1 for _, new in requests)


def attention_impls(requests: list[tuple[int, int]], flashinfer: bool) -> list[str]:
    """The rows of one attention shape: Triton always; our CUDA C++ kernel on decode-only
    shapes (its backend runs Triton for prefill); FlashInfer unless --no-flashinfer."""
    impls = ["triton"] + (["cuda"] if is_decode(requests) else [])
    return impls + (["flashinfer"] if flashinfer else [])


def flashinfer_page_table(
    seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our block tables as FlashInfer's CSR page table (CPU, int32): request r's pages are
    indices[indptr[r] : indptr[r + 1]] (its first ceil(seq_len / block_size) blocks, in order),
    and its last page holds last_page_len[r] in 1..block_size tokens."""
    pages = (seq_lens.long() + block_size - 1) // block_size
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(pages, 0)
    indices = torch.cat([block_tables[r, : int(n)] for r, n in enumerate(pages)])
    last_page_len = (seq_lens.long() - (pages - 1) * block_size).to(torch.int32)
    return indptr, indices.to(torch.int32), last_page_len


def check_page_table(seq_lens: torch.Tensor, block_tables: torch.Tensor) -> str:
    """The page table's invariants (dry run): sizes, 1 <= last_page_len <= page size, and the
    lengths it implies equal ours."""
    indptr, indices, last = flashinfer_page_table(seq_lens, block_tables, BLOCK_SIZE)
    pages = (indptr[1:] - indptr[:-1]).long()
    assert indices.numel() == int(indptr[-1]) and indices.dtype == torch.int32
    assert bool(((last >= 1) & (last <= BLOCK_SIZE)).all())
    assert torch.equal((pages - 1) * BLOCK_SIZE + last.long(), seq_lens.long())
    return f"{indices.numel()} pages"


def measure(
    row: Row, fn: Callable[[], torch.Tensor], expected: torch.Tensor, timer: Timer, gate: bool
) -> None:
    """Check fn() against the reference, then time it (warm-up first: JIT / autotune / plan
    caches stay out of the timings). An exception marks the row instead of ending the run;
    `gate`: a wrong result (or an error) fails the run (ours), else it is only reported."""
    try:
        got = fn().clone()
        torch.cuda.synchronize()
        err = max_error(got, expected)
        row.check = f"err {err:.1e}"
        if err >= ATTENTION_TOLERANCE:
            row.ok = not gate
            row.check += "" if gate else " MISMATCH (not gated)"
        row.eager_us = timer.eager(fn)
        row.us = timer.graph(fn) or row.eager_us
    except Exception as exc:  # noqa: BLE001 - report in the row, go on with the others
        _sync_quietly()
        message = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        print(f"  {row.impl} failed on {row.model} {row.shape}: {message}")
        row.us = row.eager_us = None
        row.check, row.ok = f"error {message[:100]}", not gate


def _sync_quietly() -> None:
    """Wait for the GPU after a failure; a sticky CUDA error resurfaces at the next check."""
    try:
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        print(f"  (synchronize after the failure: {type(exc).__name__}: {str(exc)[:200]})")


def triton_attention_fn(
    triton_attention: types.ModuleType, q: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, md: AttentionMetadata, scale: float,
) -> Callable[[], torch.Tensor]:  # fmt: skip
    """The Triton paged attention on these inputs, into one output buffer, as a call."""
    out = torch.empty_like(q)

    def run() -> torch.Tensor:
        return triton_attention.paged_attention(
            q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
            md.max_query_len, scale, out, max_seq_len=md.max_seq_len,
        )  # fmt: skip

    return run


def bench_attention(
    kernels: tuple, model: Model, name: str, requests: list, ctx: dict
) -> list[Row]:
    """One row per implementation on the same q, caches and block tables."""
    attention, triton_attention, _, _ = kernels
    device, dtype, timer, gen = ctx["device"], ctx["dtype"], ctx["timer"], ctx["gen"]
    elt = torch.empty(0, dtype=dtype).element_size()
    meta = attention_metadata_cpu(requests, gen)
    nbytes, flops = attention_counts(model, requests, elt)
    shape = (meta["num_blocks"], BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    k_cache = torch.randn(shape, device=device, dtype=dtype)
    v_cache = torch.randn(shape, device=device, dtype=dtype)
    num_tokens = int(meta["query_lens"].sum())
    q = torch.randn(num_tokens, model.num_heads, model.head_dim, device=device, dtype=dtype)
    md = build_attention_metadata(
        meta["query_lens"],
        meta["seq_lens"],
        meta["block_tables"],
        meta["slot_mapping"],
        BLOCK_SIZE,
        device,
    )
    scale = model.head_dim**-0.5
    expected = attention.paged_attention(q.float(), k_cache.float(), v_cache.float(), md, scale)

    def reference() -> torch.Tensor:
        return attention.paged_attention(q, k_cache, v_cache, md, scale)

    ref_us = timer.graph(reference) or timer.eager(reference)
    rows = {
        impl: Row(
            "paged_attention", impl, model.name, name, bytes=nbytes, flops=flops, ref_us=ref_us
        )
        for impl in attention_impls(requests, ctx["flashinfer"] is not False)
    }

    triton_fn = triton_attention_fn(triton_attention, q, k_cache, v_cache, md, scale)
    measure(rows["triton"], triton_fn, expected, timer, gate=True)

    if "cuda" in rows:
        row, cuda = rows["cuda"], ctx["cuda_attention"]
        if cuda is None:
            row.check = f"unavailable: {ctx['cuda_reason']}"
        elif not cuda.supported(q, k_cache):
            row.check = f"unavailable: {dtype} / group {model.num_heads // model.num_kv_heads} "
            row.check += "not instantiated"
        else:
            out_cuda = torch.empty_like(q)

            def cuda_fn() -> torch.Tensor:
                return cuda.decode(q, k_cache, v_cache, md.block_tables, md.seq_lens, scale,
                                   md.max_seq_len, out=out_cuda)  # fmt: skip

            measure(row, cuda_fn, expected, timer, gate=True)

    if "flashinfer" in rows:
        row = rows["flashinfer"]
        fi_fn = flashinfer_attention(model, md, q, k_cache, v_cache, scale, ctx)
        if isinstance(fi_fn, str):
            row.check = f"unavailable: {fi_fn}"
        else:
            measure(row, fi_fn, expected, timer, gate=False)
        for impl, other in rows.items():
            if impl != "flashinfer":
                other.flashinfer_us = row.us
    return list(rows.values())


def flashinfer_workspace(ctx: dict) -> torch.Tensor:
    """One float workspace for every wrapper (used one at a time). FlashInfer 0.5 wants it
    zeroed before its first use; 128 MB is its recommended size."""
    if ctx.get("flashinfer_workspace") is None:
        ctx["flashinfer_workspace"] = torch.zeros(
            128 * 1024 * 1024, dtype=torch.uint8, device=ctx["device"]
        )
    return ctx["flashinfer_workspace"]


def flashinfer_attention(
    model: Model, md, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    scale: float, ctx: dict,
) -> Callable[[], torch.Tensor] | str:  # fmt: skip
    """FlashInfer 0.5's paged attention on our cache, planned and warmed up (its JIT compile
    happens in plan / the first run, outside the timings): BatchDecodeWithPagedKVCacheWrapper
    when every request has one query, else BatchPrefillWithPagedKVCacheWrapper (causal, which
    FlashInfer aligns to the end of each request's keys, as ours). Layout "NHD": k and v as a
    tuple of [num_pages, page_size, num_kv_heads, head_dim], exactly our per-layer caches.
    Returns the run closure, or why FlashInfer cannot run here."""
    flashinfer = ctx["flashinfer"]
    if flashinfer is None:
        return ctx["flashinfer_reason"]
    device = q.device
    try:
        start = time.perf_counter()
        page_table = flashinfer_page_table(md.seq_lens_cpu, md.block_tables_cpu, BLOCK_SIZE)
        indptr, indices, last_page_len = (t.to(device) for t in page_table)
        workspace = flashinfer_workspace(ctx)
        if md.max_query_len == 1:
            kind = "decode"
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=ctx["flashinfer_tensor_cores"]
            )
            wrapper.plan(
                indptr, indices, last_page_len,
                num_qo_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                head_dim=model.head_dim, page_size=BLOCK_SIZE, pos_encoding_mode="NONE",
                sm_scale=scale, q_data_type=q.dtype, kv_data_type=k_cache.dtype,
            )  # fmt: skip
        else:
            kind = "prefill"
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            wrapper.plan(
                md.query_start_loc.to(device), indptr, indices, last_page_len,
                num_qo_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                head_dim_qk=model.head_dim, page_size=BLOCK_SIZE, causal=True,
                pos_encoding_mode="NONE", sm_scale=scale, q_data_type=q.dtype,
                kv_data_type=k_cache.dtype,
            )  # fmt: skip
        out = torch.empty_like(q)

        def run() -> torch.Tensor:
            return wrapper.run(q, (k_cache, v_cache), out=out)

        run()  # warm-up: any remaining JIT / lazy init
        torch.cuda.synchronize()
        print(f"  flashinfer {kind}: plan + JIT + warm-up {time.perf_counter() - start:.1f}s")
        return run
    except Exception as exc:  # noqa: BLE001 - API drift, unsupported shape: report, go on
        _sync_quietly()
        message = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        print(f"  flashinfer failed on {model.name} (plan): {message}")
        return message[:100]


def attention_summary(rows: list[Row]) -> list[str]:
    """One line per attention shape: which of Triton / CUDA is faster (GPU time), and each
    against FlashInfer."""
    shapes: dict[tuple[str, str], dict[str, Row]] = {}
    for row in rows:
        if row.kernel == "paged_attention":
            shapes.setdefault((row.model, row.shape), {})[row.impl] = row
    lines = []
    for (model, shape), impls in shapes.items():
        triton, cuda, fi = (impls.get(k) for k in ("triton", "cuda", "flashinfer"))
        if triton is None:
            continue
        if cuda is None:
            verdict = f"Triton only ({_us(triton)}; the cuda backend runs Triton here)"
        elif triton.us is None or cuda.us is None:
            timed, untimed = (triton, cuda) if cuda.us is None else (cuda, triton)
            verdict = f"{_name(timed)} {_us(timed)}; {_name(untimed)} {untimed.check}"
        else:
            fast, slow = (cuda, triton) if cuda.us < triton.us else (triton, cuda)
            verdict = (
                f"{_name(fast)} faster than {_name(slow)} by {slow.us / fast.us:.2f}x "
                f"(Triton {_us(triton)}, CUDA {_us(cuda)})"
            )
        if fi is not None and fi.us is not None:
            verdict += f"; FlashInfer {_us(fi)}"
            for ours in (triton, cuda):
                if ours is not None and ours.us is not None:
                    verdict += f", {_name(ours)}/FI {ours.us / fi.us:.2f}"
        elif fi is not None:
            verdict += f"; FlashInfer {fi.check}"
        lines.append(f"{model} {shape}: {verdict}")
    return lines


def _us(row: Row) -> str:
    return "not timed" if row.us is None else f"{row.us:.1f} µs"


def _name(row: Row) -> str:
    return {"triton": "Triton", "cuda": "CUDA", "flashinfer": "FlashInfer"}[row.impl]


# --------------------------------------------------------------------------- small ops


def bench_ops(kernels: tuple, model: Model, phase: str, tokens: int, ctx: dict) -> list[Row]:
    attention, triton_attention, triton_ops, _ = kernels
    ref = triton_ops.reference
    device, dtype, timer = ctx["device"], ctx["dtype"], ctx["timer"]
    elt = torch.empty(0, dtype=dtype).element_size()
    rows = []

    def add(kernel: str, shape: str, nbytes: int, ours, reference, compare) -> None:
        row = Row(kernel, "triton", model.name, f"{phase} {shape}", bytes=nbytes)
        err = compare(ours(), reference())
        # a rounding flip before the weight multiply can cost 2 bf16 ulps (2^-6) after it
        row.check, row.ok = f"rel err {err:.1e}", err < 2e-2
        timer.time(row, ours, reference)
        rows.append(row)

    # write_kv_cache
    kv_shape = (tokens, model.num_kv_heads, model.head_dim)
    key = torch.randn(kv_shape, device=device, dtype=dtype)
    value = torch.randn(kv_shape, device=device, dtype=dtype)
    num_blocks = tokens // BLOCK_SIZE * 2
    cache_shape = (num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    caches = [torch.zeros(cache_shape, device=device, dtype=dtype) for _ in range(4)]
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:tokens]

    def write_ours() -> torch.Tensor:
        triton_attention.write_kv_cache(key, value, caches[0], caches[1], slots)
        return caches[0]

    def write_ref() -> torch.Tensor:
        attention.write_kv_cache(key, value, caches[2], caches[3], slots)
        return caches[2]

    add("write_kv_cache", f"{tokens} tok", 4 * key.numel() * elt, write_ours, write_ref,
        rel_error)  # fmt: skip

    hidden = torch.randn(tokens, model.hidden, device=device, dtype=dtype)
    residual = torch.randn(tokens, model.hidden, device=device, dtype=dtype)
    weight = 1 + 0.1 * torch.randn(model.hidden, device=device, dtype=dtype)
    act = hidden.numel() * elt
    add("rms_norm", f"{tokens}x{model.hidden}", 2 * act,
        lambda: triton_ops.rms_norm(hidden, weight, 1e-6),
        lambda: ref.rms_norm(hidden, weight, 1e-6), rel_error)  # fmt: skip
    add("fused_add_rms_norm", f"{tokens}x{model.hidden}", 4 * act,
        lambda: triton_ops.fused_add_rms_norm(hidden, residual, weight, 1e-6),
        lambda: ref.fused_add_rms_norm(hidden, residual, weight, 1e-6), rel_error2)  # fmt: skip

    q_size, kv_size = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, device=device, dtype=dtype)
    q = qkv[:, :q_size].view(tokens, model.num_heads, model.head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, model.num_kv_heads, model.head_dim)
    positions = torch.randint(0, 8192, (tokens,), device=device)
    freqs = torch.arange(8192, device=device)[:, None] * torch.rand(model.head_dim // 2,
                                                                    device=device)  # fmt: skip
    cos_cache, sin_cache = freqs.cos().to(dtype), freqs.sin().to(dtype)

    def rotary_ref() -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_cache[positions], sin_cache[positions]
        return ref.apply_rotary(q, cos, sin), ref.apply_rotary(k, cos, sin)

    add("apply_rotary_qk", f"{tokens}x({model.num_heads}+{model.num_kv_heads})x{model.head_dim}",
        2 * (q.numel() + k.numel()) * elt,
        lambda: triton_ops.apply_rotary_qk(q, k, positions, cos_cache, sin_cache), rotary_ref,
        rel_error2)  # fmt: skip

    gate_up = torch.randn(tokens, 2 * model.intermediate, device=device, dtype=dtype)
    add("silu_and_mul", f"{tokens}x{model.intermediate}", gate_up.numel() * elt * 3 // 2,
        lambda: triton_ops.silu_and_mul(gate_up), lambda: ref.silu_and_mul(gate_up),
        rel_error)  # fmt: skip
    return rows


# --------------------------------------------------------------------------- sampling


def torch_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The sort-based torch path: scale, sort, top-k/top-p mask, softmax, exponential race."""
    z = logits / temperature.unsqueeze(1)
    sorted_z, order = z.sort(dim=-1, descending=True)
    kth = sorted_z.gather(1, (top_k - 1).unsqueeze(1))
    sorted_z = sorted_z.masked_fill(sorted_z < kth, float("-inf"))
    probs = sorted_z.softmax(dim=-1)
    outside = probs.cumsum(dim=-1) - probs >= top_p.unsqueeze(1)
    sorted_z = sorted_z.masked_fill(outside, float("-inf"))
    probs = torch.empty_like(z).scatter_(1, order, sorted_z).softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return probs.div_(noise).argmax(dim=-1)


def bench_sampling(kernels: tuple, model: Model, batch: int, ctx: dict) -> list[Row]:
    triton_sampling = kernels[3]
    device, timer = ctx["device"], ctx["timer"]
    logits = 4 * torch.randn(batch, model.vocab, device=device)
    temperature = torch.full((batch,), 0.8, device=device)
    top_k = torch.full((batch,), 50, device=device)
    top_p = torch.full((batch,), 0.9, device=device)
    seeds = torch.arange(batch, device=device)
    thresholds = triton_sampling.sampling_thresholds(logits, temperature, top_k, top_p)
    z = logits / temperature.unsqueeze(1)
    keep = z >= thresholds.unsqueeze(1)
    expected = triton_sampling.reference_keep_mask(logits, temperature, top_k, top_p)
    boundary = z.masked_fill(~expected, float("inf")).amin(dim=1, keepdim=True)
    mismatches = int(((keep != expected) & (z != boundary)).sum())  # ties at the edge: see tests
    shape = f"{batch}x{model.vocab} k50 p0.9"
    rows = []
    for kernel, ours in (
        ("sampling_thresholds", lambda: triton_sampling.sampling_thresholds(
            logits, temperature, top_k, top_p)),
        ("sample_from_logits", lambda: triton_sampling.sample_from_logits(
            logits, temperature, seeds, None, top_k, top_p)),
    ):  # fmt: skip
        row = Row(kernel, "triton", model.name, shape, bytes=logits.numel() * 4)
        row.check, row.ok = f"{mismatches} mismatches", mismatches == 0
        timer.time(row, ours, lambda: torch_sample(logits, temperature, top_k, top_p))
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- skinny linear


def projection_shapes(model: Model) -> list[tuple[str, int, int]]:
    """(name, N, K) of the weights a decode step streams: the four per-layer projections (q, k
    and v fused; gate and up fused) and the LM head (the whole vocabulary, TP 1)."""
    q_size, kv_size = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    return [
        ("qkv", q_size + 2 * kv_size, model.hidden),
        ("o_proj", model.hidden, q_size),
        ("gate_up", 2 * model.intermediate, model.hidden),
        ("down", model.hidden, model.intermediate),
        ("lm_head", model.vocab, model.hidden),
    ]


def load_gemv() -> tuple[types.ModuleType | None, str]:
    """pagedserve.kernels.triton_gemv, or None and why it cannot be imported."""
    import_package()
    try:
        return importlib.import_module("pagedserve.kernels.triton_gemv"), ""
    except Exception as exc:  # noqa: BLE001 - triton missing or broken: report in the rows
        return None, " ".join(f"{type(exc).__name__}: {exc}".split())[:100]


def gemv_plan(gemv: types.ModuleType, m: int, n: int, k: int, elt: int, sms: int) -> str:
    plan = gemv.plan_skinny_linear(m, n, k, sms, element_size=elt)
    return f"plan {plan.describe()}"


def ulp_error(got: torch.Tensor, weight: torch.Tensor, x: torch.Tensor) -> float:
    """Max |got - ref| in units in the last place of got's dtype, ref = F.linear in fp32
    rounded once (computed in row chunks: no fp32 copy of a 1 GB weight)."""
    x32 = x.float()
    worst = 0.0
    mantissa = {torch.bfloat16: 8, torch.float16: 11}[got.dtype]
    for start in range(0, weight.shape[0], 16384):
        ref = torch.nn.functional.linear(x32, weight[start : start + 16384].float())
        ref = ref.to(got.dtype).float()
        _, exponent = torch.frexp(ref)
        ulp = torch.ldexp(torch.ones_like(ref), exponent - mantissa)
        diff = (got[:, start : start + 16384].float() - ref).abs() / ulp
        worst = max(worst, float(diff.max()))
    return worst


def bench_gemv(kernels: tuple, model: Model, ctx: dict) -> list[Row]:
    """skinny_linear against F.linear (cuBLAS) on every projection of the model, at each of
    GEMV_BATCHES rows: one weight per projection, reused across the batches."""
    gemv, device, dtype, timer = ctx["gemv"], ctx["device"], ctx["dtype"], ctx["timer"]
    elt = torch.empty(0, dtype=dtype).element_size()
    rows = []
    for name, n, k in projection_shapes(model):
        weight = (torch.randn(n, k, device=device) * k**-0.5).to(dtype)
        for m in GEMV_BATCHES:
            x = torch.randn(m, k, device=device, dtype=dtype)
            shape = f"{name} M={m} {n}x{k}"
            ours = Row("linear", "triton", model.name, shape, bytes=n * k * elt)
            theirs = Row("linear", "cublas", model.name, shape, bytes=n * k * elt)
            rows += [ours, theirs]
            if gemv is None:
                ours.check, ours.ok = f"unavailable: {ctx['gemv_reason']}", False
                continue

            def ours_fn(x: torch.Tensor = x, weight: torch.Tensor = weight) -> torch.Tensor:
                return gemv.skinny_linear(x, weight)

            def cublas_fn(x: torch.Tensor = x, weight: torch.Tensor = weight) -> torch.Tensor:
                return torch.nn.functional.linear(x, weight)

            try:
                err = ulp_error(ours_fn(), weight, x)
                ours.check, ours.ok = f"err {err:.2f} ulp", err <= 1.0
                theirs.check = f"err {ulp_error(cublas_fn(), weight, x):.2f} ulp"
                timer.time(ours, ours_fn, cublas_fn)
                theirs.us, theirs.eager_us = ours.ref_us, timer.eager(cublas_fn)
                if ours.us and theirs.us:
                    ours.check += f"; {theirs.us / ours.us:.2f}x cuBLAS"
                ours.check += "; " + gemv_plan(gemv, m, n, k, elt, ctx["num_sms"])
            except Exception as exc:  # noqa: BLE001 - report in the row, go on with the others
                _sync_quietly()
                message = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
                print(f"  skinny_linear failed on {model.name} {shape}: {message}")
                ours.check, ours.ok = f"error {message[:100]}", False
        del weight
    return rows


def gemv_summary(rows: list[Row]) -> list[str]:
    """Per model and batch: the four per-layer projections summed (one decoder layer's weight
    streaming) and the LM head, skinny_linear against cuBLAS (GPU time)."""
    totals: dict[tuple[str, int], dict[str, dict[str, float]]] = {}
    for row in rows:
        if row.kernel != "linear" or row.us is None:
            continue
        name, batch = row.shape.split()[0], int(row.shape.split()[1].removeprefix("M="))
        part = "lm_head" if name == "lm_head" else "layer"
        slot = totals.setdefault((row.model, batch), {}).setdefault(part, {})
        slot[row.impl] = slot.get(row.impl, 0.0) + row.us
        slot[row.impl + " bytes"] = slot.get(row.impl + " bytes", 0.0) + row.bytes
    lines = []
    for (model, batch), parts in totals.items():
        cells = []
        for part, label in (("layer", "per layer (qkv+o+gate_up+down)"), ("lm_head", "lm_head")):
            t = parts.get(part, {})
            if "triton" in t and "cublas" in t:
                gbps = t["triton bytes"] / t["triton"] / 1e3
                cells.append(f"{label} {t['triton']:.1f} µs vs cuBLAS {t['cublas']:.1f} µs "
                             f"({t['cublas'] / t['triton']:.2f}x, {gbps:.0f} GB/s)")  # fmt: skip
        if cells:
            lines.append(f"{model} M={batch}: " + "; ".join(cells))
    return lines


# --------------------------------------------------------------------------- sweep

SWEEP_MIXED = [(0, 7), (40, 1), (0, 1), (33, 20), (5, 1), (17, 16), (0, 150), (300, 1)]
SWEEP_DECODE = [(c, 1) for c in (0, 3, 15, 16, 63, 64, 79, 1000, 4095)]


def sweep(kernels: tuple, device: torch.device) -> list[Row]:
    """--sweep: attention correctness over odd shapes (block sizes 1..256, GQA 1..8, group 3,
    head_dim 16..128 and 80, fp32/fp16/bf16, split-K forced), small batches."""
    attention, triton_attention, _, _ = kernels
    rows = []
    configs = [
        (bs, heads, kv, dim, dtype, requests, splits)
        for bs in (1, 16, 256)
        for heads, kv, dim in ((4, 4, 16), (8, 2, 32), (12, 4, 64), (32, 4, 128), (6, 2, 80))
        for dtype in (torch.float32, torch.bfloat16)
        for requests, splits in ((SWEEP_MIXED, None), (SWEEP_DECODE, None), (SWEEP_DECODE, 5))
    ]
    configs += [(8, 8, 2, 128, torch.float16, SWEEP_MIXED, None)]
    gen = torch.Generator().manual_seed(1)
    for bs, heads, kv, dim, dtype, requests, splits in configs:
        blocks = [math.ceil((c + n) / bs) for c, n in requests]
        pool = torch.randperm(sum(blocks) + 2, generator=gen)
        table = torch.zeros(len(requests), max(blocks) + 1, dtype=torch.int32)
        start = 0
        for r, n in enumerate(blocks):
            table[r, :n] = pool[start : start + n].to(torch.int32)
            start += n
        shape = (sum(blocks) + 2, bs, kv, dim)
        k_cache = torch.randn(shape, device=device).to(dtype)
        v_cache = torch.randn(shape, device=device).to(dtype)
        num_tokens = sum(n for _, n in requests)
        q = torch.randn(num_tokens, heads, dim, device=device).to(dtype)
        md = build_attention_metadata(
            torch.tensor([n for _, n in requests]),
            torch.tensor([c + n for c, n in requests]),
            table,
            torch.zeros(num_tokens, dtype=torch.long),
            bs,
            device,
        )
        out = triton_attention.paged_attention(
            q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
            md.max_query_len, dim**-0.5, num_splits=splits,
        )  # fmt: skip
        ref = attention.paged_attention(q.float(), k_cache.float(), v_cache.float(), md,
                                        dim**-0.5)  # fmt: skip
        err = max_error(out, ref)
        kind = "mixed" if md.max_query_len > 1 else f"decode splits={splits}"
        row = Row("sweep paged_attention", "triton", f"{heads}/{kv}x{dim}",
                  f"bs{bs} {kind} {dtype}")  # fmt: skip
        row.check, row.ok = f"err {err:.1e}", err < (2e-5 if dtype == torch.float32 else 3e-2)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="also write the table to this markdown file")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--models", nargs="*", default=[m.name for m in MODELS],
                        choices=[m.name for m in MODELS])  # fmt: skip
    parser.add_argument("--only", nargs="*", choices=["attention", "ops", "sampling", "gemv"],
                        default=["attention", "ops", "sampling", "gemv"])  # fmt: skip
    parser.add_argument("--no-flashinfer", action="store_true", help="skip FlashInfer")
    parser.add_argument("--no-cuda-kernel", action="store_true",
                        help="skip our CUDA C++ decode kernel (no nvcc build)")  # fmt: skip
    parser.add_argument("--flashinfer-tensor-cores", action="store_true",
                        help="FlashInfer's decode wrapper with use_tensor_cores=True")  # fmt: skip
    parser.add_argument("--sweep", action="store_true", help="first a correctness sweep")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU only: parse, build the shapes and byte counts, print the plan",
    )
    return parser.parse_args(argv)


def dry_run(args: argparse.Namespace, models: list[Model]) -> list[Row]:
    """The plan: every row with its shape and byte / flop counts, nothing launched."""
    elt = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    gen = torch.Generator().manual_seed(0)
    cuda_reason = fi_reason = ""
    if "attention" in args.only:
        # the availability probes of a real run; with CUDA here, skip the nvcc build
        if args.no_cuda_kernel:
            cuda_reason = "skipped (--no-cuda-kernel)"
        elif torch.cuda.is_available():
            cuda_reason = ""
        else:
            cuda_reason = load_cuda_attention()[1]
        if not args.no_flashinfer:
            fi_reason = load_flashinfer()[1]
    gemv, gemv_reason = load_gemv() if "gemv" in args.only else (None, "")
    rows = []
    for model in models:
        if "attention" in args.only:
            for name, requests in ATTENTION_CASES.items():
                meta = attention_metadata_cpu(requests, gen)
                assert meta["slot_mapping"].unique().numel() == meta["slot_mapping"].numel()
                pages = check_page_table(meta["seq_lens"], meta["block_tables"])
                nbytes, flops = attention_counts(model, requests, elt)
                for impl in attention_impls(requests, not args.no_flashinfer):
                    row = Row("paged_attention", impl, model.name, name, bytes=nbytes,
                              flops=flops)  # fmt: skip
                    reason = {"cuda": cuda_reason, "flashinfer": fi_reason}.get(impl, "")
                    row.check = f"{meta['num_blocks']} blocks, {nbytes / 1e6:.0f} MB, {pages}"
                    if reason:
                        row.check = f"unavailable: {reason}"
                    rows.append(row)
        if "ops" in args.only:
            for phase, tokens in OP_TOKENS.items():
                for kernel in ("write_kv_cache", "rms_norm", "fused_add_rms_norm",
                               "apply_rotary_qk", "silu_and_mul"):  # fmt: skip
                    rows.append(Row(kernel, "triton", model.name, f"{phase} {tokens} tok"))
        if "sampling" in args.only:
            for batch in SAMPLING_BATCHES:
                for kernel in ("sampling_thresholds", "sample_from_logits"):
                    shape = f"{batch}x{model.vocab} k50 p0.9"
                    rows.append(Row(kernel, "triton", model.name, shape))
        if "gemv" in args.only:
            for name, n, k in projection_shapes(model):
                for m in GEMV_BATCHES:
                    for impl in ("triton", "cublas"):
                        row = Row("linear", impl, model.name, f"{name} M={m} {n}x{k}",
                                  bytes=n * k * elt)  # fmt: skip
                        row.check = f"{n * k * elt / 1e6:.1f} MB"
                        if impl == "triton":  # the launch an H200 (132 SMs) gets
                            extra = gemv_plan(gemv, m, n, k, elt, 132) if gemv else gemv_reason
                            row.check += f"; {extra}"
                        rows.append(row)
    return rows


def run(args: argparse.Namespace, models: list[Model]) -> list[Row]:
    kernels = import_kernels()
    device = torch.device("cuda")
    torch.manual_seed(0)
    # False: --no-flashinfer (no rows); None: not importable (rows marked unavailable)
    flashinfer, fi_reason = (False, "skipped") if args.no_flashinfer else load_flashinfer()
    cuda_attention, cuda_reason = None, "skipped (--no-cuda-kernel)"
    if "attention" in args.only and not args.no_cuda_kernel:
        cuda_attention, cuda_reason = load_cuda_attention()
    ctx = {
        "device": device,
        "dtype": getattr(torch, args.dtype),
        "timer": Timer(device),
        "gen": torch.Generator().manual_seed(0),
        "flashinfer": flashinfer,
        "flashinfer_reason": fi_reason,
        "flashinfer_tensor_cores": args.flashinfer_tensor_cores,
        "cuda_attention": cuda_attention,
        "cuda_reason": cuda_reason,
    }
    if "gemv" in args.only:
        ctx["gemv"], ctx["gemv_reason"] = load_gemv()
        ctx["num_sms"] = torch.cuda.get_device_properties(device).multi_processor_count
    rows: list[Row] = sweep(kernels, device) if args.sweep else []
    for model in models:
        sections = []
        if "attention" in args.only:
            sections += [(bench_attention, (model, n, r)) for n, r in ATTENTION_CASES.items()]
        if "ops" in args.only:
            sections += [(bench_ops, (model, p, t)) for p, t in OP_TOKENS.items()]
        if "sampling" in args.only:
            sections += [(bench_sampling, (model, b)) for b in SAMPLING_BATCHES]
        if "gemv" in args.only:
            sections += [(bench_gemv, (model,))]
        for fn, fn_args in sections:
            start = time.perf_counter()
            new_rows = fn(kernels, *fn_args, ctx)
            for row in new_rows:
                print(" | ".join(row.cells()), f"({time.perf_counter() - start:.1f}s)")
            rows += new_rows
            workspace = getattr(kernels[0], "_WORKSPACE", None)  # the reference's scratch
            if workspace is not None:
                workspace.clear()
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    models = [m for m in MODELS if m.name in args.models]
    started = time.perf_counter()
    if args.dry_run:
        rows = dry_run(args, models)
        title = "Kernels: plan (dry run, nothing timed)"
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --dry-run on a CPU machine")
            return 2
        rows = run(args, models)
        title = f"Kernels on {torch.cuda.get_device_name()}"
    table = markdown(rows)
    print(table)
    summary = attention_summary(rows)
    if summary:
        print("\nAttention, Triton vs CUDA (GPU time):")
        print("\n".join(f"  {line}" for line in summary))
    linear_lines = gemv_summary(rows)
    if linear_lines:
        print("\nLinear, skinny_linear vs cuBLAS (GPU time, summed over the projections):")
        print("\n".join(f"  {line}" for line in linear_lines))
    summary += linear_lines
    if args.out is not None:
        import triton

        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = "python scripts/gpu/bench_kernels.py " + " ".join(sys.argv[1:])
        args.out.write_text(
            f"# {title}\n\n{datetime.datetime.now():%Y-%m-%d %H:%M}, torch {torch.__version__}, "
            f"triton {triton.__version__}, {args.dtype}, KV block {BLOCK_SIZE}; "
            f"`{command}` ({time.perf_counter() - started:.0f} s)\n\n{table}\n"
            + "".join(f"\n- {line}" for line in summary)
            + ("\n" if summary else "")
        )
        print(f"wrote {args.out}")
    return 0 if all(row.ok for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
