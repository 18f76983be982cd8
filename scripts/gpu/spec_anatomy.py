"""Anatomy of a speculative-decoding step (issue 12), worker-level and engine-level.

Worker-level (a ModelRunner, no actors): the `target` preset's Llama of
scripts/train_tiny_model.py with dummy weights (the same shape as the benchmark's trained
target) and, as its draft, the embedded 4M model; batch 1 and 64; draft k=3 and n-gram k=4
(a periodic prompt, so that a lookup always proposes). For each: the time of a plain decode
step, of a whole speculative step (verify, accept, propose), and of its parts run alone (a
device sync before and after each: the verify forward, the proposer's propose, each draft
decode, the draft's observe), the kernel launches, graph replays, copies and host syncs per
part (torch.profiler's runtime calls), and whether each static step's graph replay gives its
eager run's logits. Engine-level (LLM through the actors, ProfileConfig's loop timers and
step log): batch 1 ms per step with no speculation, draft k=3 and n-gram k=4, and where a
step's time goes (worker host, device, waiting for the next plan: the round trip through the
scheduler). Dummy weights: acceptance rates mean nothing here; the timings do.

    python scripts/gpu/spec_anatomy.py [--batches 1 64] [--context 200] [--no-engine]
        [--device cuda] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
from train_tiny_model import PRESETS  # noqa: E402

from pagedserve.actors.messages import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    StepPlan,
    StepResult,
)
from pagedserve.actors.worker import startup  # noqa: E402
from pagedserve.actors.worker.model_runner import ModelRunner  # noqa: E402
from pagedserve.config import EngineConfig, ProfileConfig, SpeculativeConfig  # noqa: E402
from pagedserve.kernels.attention_metadata import cdiv  # noqa: E402

DRAFT = ROOT / "pagedserve" / "assets" / "tiny-shakespeare"
GREEDY = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
PERIOD = 40  # the prompt repeats every PERIOD tokens: an n-gram lookup always matches
# (owner, method, label) of the parts timed alone, where the owner has them
PARTS = (
    ("runner", "run_decode", "verify forward (target, as a decode step)"),
    ("proposer", "propose_after_verify", "drafts after the verify (on the device)"),
    ("proposer", "propose", "drafts from the host's tokens"),
    ("proposer", "observe", "draft observe (general steps)"),
    ("chain", "start_after_verify", "chain start from the verify's samples"),
    ("chain", "run", "draft chain (k decodes)"),
)
RUNTIME_CALLS = {
    "kernel launches": ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                        "cuLaunchKernelEx", "cudaLaunchCooperativeKernel"),
    "graph replays": ("cudaGraphLaunch", "cuGraphLaunch"),
    "copies": ("cudaMemcpyAsync", "cudaMemsetAsync"),
    "host syncs": ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
                   "cudaMemcpy"),
}  # fmt: skip


def target_dir(out: Path, shape: dict | None = None) -> Path:
    """The `target` preset's config (or the embedded model's with `shape` over it; dummy
    weights) with the embedded model's tokenizer."""
    config = json.loads((DRAFT / "config.json").read_text())
    config |= PRESETS["target"] if shape is None else shape
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in DRAFT.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "generation")):
            shutil.copy(name, out / name.name)
    return out


def git_revision() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)  # fmt: skip
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SpecSession:
    """`batch` requests with `context` computed tokens of a periodic prompt, stepped through
    runner.execute as the scheduler would step them: a speculative step verifies each
    request's last proposals (1 + d tokens) and asks for new ones; a request's computed count
    then follows the tokens the step emitted for it."""

    def __init__(
        self, runner: ModelRunner, batch: int, context: int, first_block: int, k: int
    ) -> None:
        self.runner, self.batch, self.k = runner, batch, k
        self.ids = [batch * 100_000 + i for i in range(batch)]
        self.num_computed = dict.fromkeys(self.ids, context)
        self.drafts: dict[int, list[int]] = {h: [] for h in self.ids}
        self.blocks_per_request = cdiv(min(context + 700, 1024), runner.block_size)
        self.step_id = 0
        self.pending_new = []
        for i, handle in enumerate(self.ids):
            start = first_block + i * self.blocks_per_request
            blocks = list(range(start, start + self.blocks_per_request))
            tokens = [(7 * i + t % PERIOD) % 1000 + 10 for t in range(context + 1)]
            self.pending_new.append(
                NewRequestData(handle, tokens, len(tokens), GREEDY, i, blocks, context)
            )

    @property
    def num_blocks(self) -> int:
        return self.batch * self.blocks_per_request

    def plan(self, speculate: bool) -> StepPlan:
        cached = CachedRequestData()
        if not self.pending_new:
            cached = CachedRequestData([self.num_computed[h] for h in self.ids], [0] * self.batch)
        drafts = [self.drafts[h] if speculate else [] for h in self.ids]
        plan = StepPlan(
            step_id=self.step_id, new_requests=self.pending_new, cached_requests=cached,
            scheduled=list(self.ids), num_scheduled_tokens=[1 + len(d) for d in drafts],
            spec_token_ids=drafts, propose=speculate,
        )  # fmt: skip
        self.pending_new = []
        self.step_id += 1
        return plan

    def step(self, speculate: bool) -> StepResult:
        result = self.runner.execute(self.plan(speculate))
        counts = result.num_sampled or [1] * len(result.handles)
        for i, (handle, count) in enumerate(zip(result.handles, counts)):
            self.num_computed[handle] += count
            proposed = result.draft_token_ids[i] if result.draft_token_ids else []
            # k drafts always (a random target's n-grams rarely match): the verify's cost
            self.drafts[handle] = (proposed + [11] * self.k)[: self.k]
        return result

    def close(self) -> None:
        for handle in self.ids:
            self.runner.input_batch.remove_request(handle)


def time_steps(session: SpecSession, speculate: bool, iters: int) -> tuple[float, float]:
    """Median ms of a step run to completion, and the mean tokens a request emits per step."""
    device, times, emitted = session.runner.device, [], []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        result = session.step(speculate)
        sync(device)
        times.append(time.perf_counter() - start)
        emitted.append(sum(result.num_sampled or [1] * len(result.handles)) / session.batch)
    return statistics.median(times) * 1e3, statistics.mean(emitted)


@contextmanager
def wrapped(session: SpecSession, wrap: Callable[[str, Callable], Callable]) -> Iterator[None]:
    """PARTS of the runner and its proposer replaced by wrap(label, method) while inside."""
    proposer = session.runner.proposer
    owners = {
        "runner": session.runner,
        "proposer": proposer,
        "chain": getattr(proposer, "chain", None),
    }
    installed = []
    for owner_name, attribute, label in PARTS:
        owner = owners[owner_name]
        if owner is not None and hasattr(owner, attribute):
            setattr(owner, attribute, wrap(label, getattr(owner, attribute)))
            installed.append((owner, attribute))
    try:
        yield
    finally:
        for owner, attribute in installed:
            delattr(owner, attribute)  # the class's method again


def time_parts(session: SpecSession, iters: int) -> dict[str, tuple[float, float]]:
    """Per part: (median ms of one call, calls per step), each call between device syncs."""
    device = session.runner.device
    calls: dict[str, list[float]] = {}

    def timed(label: str, method: Callable) -> Callable:
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            sync(device)
            start = time.perf_counter()
            out = method(*args, **kwargs)
            sync(device)
            calls.setdefault(label, []).append(time.perf_counter() - start)
            return out

        return call

    with wrapped(session, timed):
        for _ in range(iters):
            session.step(True)
    return {k: (statistics.median(v) * 1e3, len(v) / iters) for k, v in calls.items()}


def count_calls(session: SpecSession, speculate: bool, steps: int) -> dict[str, dict[str, float]]:
    """Runtime calls per step (kernel launches, graph replays, copies, host syncs) of the
    whole step and, in a speculative step, of each part (its record_function range)."""

    def labelled(label: str, method: Callable) -> Callable:
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            with torch.profiler.record_function(f"part/{label}"):
                return method(*args, **kwargs)

        return call

    whole = "speculative step" if speculate else "plain decode step"
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        with wrapped(session, labelled) if speculate else nullcontext():
            for _ in range(steps):
                with torch.profiler.record_function(f"part/{whole}"):
                    session.step(speculate)
        sync(session.runner.device)
    counts: dict[str, dict[str, float]] = {}
    for event in prof.events():
        if event.name.startswith("part/"):
            part = counts.setdefault(event.name[5:], dict.fromkeys(RUNTIME_CALLS, 0.0))
            for child in descendants(event):
                for kind, names in RUNTIME_CALLS.items():
                    part[kind] += (child.name in names) / steps
    return counts


def descendants(event):  # noqa: ANN001, ANN201
    stack = list(event.cpu_children)
    while stack:
        child = stack.pop()
        yield child
        stack.extend(child.cpu_children)


def graph_checks(runner: ModelRunner, batch: int, k: int) -> list[str]:
    """The target's decode graph for the last verify (batch * (1 + k) rows) against its
    forward run eagerly on the same inputs (the same fed tokens, restored in between; KV
    writes are idempotent), and the draft chain's graphs (from the host's start record, and
    from the verify's samples) against the chain run eagerly from the same start (its
    proposals)."""
    lines = []
    step = runner.decode_step
    if step is None or not step.graphs:
        lines.append("target: no graphs")
    else:
        size = step.padded_size(batch * (1 + k))
        graph, output = step.graphs[size]
        saved = step.sampled.clone()
        with torch.inference_mode():
            graph.replay()
            graph_logits = output.clone()
            step.sampled.copy_(saved)
            eager = step.forward(size, step.metadata(size, step.max_model_len))
            step.sampled.copy_(saved)
        diff = (graph_logits.float() - eager.float()).abs().max().item()
        same = bool((graph_logits.argmax(-1) == eager.argmax(-1)).all())
        lines.append(f"target verify ({size} rows): graph vs eager max |logit diff| {diff:.3g}, "
                     f"argmax equal: {same}")  # fmt: skip
    chain = getattr(runner.proposer, "chain", None)
    if chain is not None and chain.graphs:
        size = chain.padded_size(batch)
        with torch.inference_mode():
            chain.graphs[size].replay()
            graph_drafts = chain.proposals[:size].clone()
            chain.forward(size)  # at the model's length, as captured
        same = bool((graph_drafts == chain.proposals[:size]).all())
        lines.append(f"draft chain ({size} rows, k={k}): graph vs eager drafts equal: {same}")
    if chain is not None and chain.graphs_after_verify and step is not None:
        size = chain.padded_size(batch)
        with torch.inference_mode():  # its start from the target's last verify, in the graph
            chain.graphs_after_verify[size].replay()
            graph_drafts = chain.proposals[:size].clone()
            chain.start_after_verify(step, size)
            chain.forward(size)
        same = bool((graph_drafts == chain.proposals[:size]).all())
        lines.append(f"draft chain after the verify ({size} rows): graph vs eager drafts "
                     f"equal: {same}")  # fmt: skip
    return lines


def scheduled_steps(runner: ModelRunner, tokens: int) -> str:
    """Batch 1 driven by the real Scheduler in this process (no actors, no sockets): median ms
    of runner.execute per step and tokens per step. Against the engine level, the difference
    is the round trip through the actors; against the session above, the scheduler's plans."""
    from pagedserve.actors.messages import AddRequest
    from pagedserve.actors.scheduler.scheduler import Scheduler

    config = runner.config
    assert config.num_kv_blocks is not None
    scheduler = Scheduler(config, config.num_kv_blocks)
    prompt = [(t % PERIOD) + 10 for t in range(120)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    scheduler.add_request(AddRequest(client=b"anatomy", seq=0, prompt_token_ids=prompt,
                                     sampling=params, eos_token_ids=[0]))  # fmt: skip
    times, emitted = [], 0
    while (plan := scheduler.schedule()) is not None:
        sync(runner.device)
        start = time.perf_counter()
        result = runner.execute(plan)
        sync(runner.device)
        times.append(time.perf_counter() - start)
        emitted += sum(result.num_sampled or [1] * len(result.handles))
        scheduler.update_from_result(result)
    for handle in list(runner.input_batch.row_of):  # the finish that no later plan tells
        runner.input_batch.remove_request(handle)
    steady = times[3:] or times
    return (f"- scheduler-driven, batch 1, {tokens} tokens in this process: "
            f"{statistics.median(steady) * 1e3:.3f} ms per step (median), "
            f"{emitted / len(times):.2f} tokens per step")  # fmt: skip


def prefill_check(runner: ModelRunner, prompt_len: int = 128) -> list[str]:
    """Issue 15: a lone request's prompt of `prompt_len` tokens as rows of the decode graphs
    (static_prefill) against the eager prefill path: host time of the launch, time to its
    first token, and whether the token and its logprobs agree (the second of two runs each)."""
    assert runner.config.num_kv_blocks is not None
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    tokens = [(7 * t) % 1000 + 10 for t in range(prompt_len)]
    width = cdiv(prompt_len + 16, runner.block_size)
    original, outcome = runner.static_prefill, {}
    for index, static in enumerate((True, True, False, False)):
        runner.static_prefill = static
        blocks = list(range(runner.config.num_kv_blocks - width, runner.config.num_kv_blocks))
        handle = 900_000 + index
        new = NewRequestData(handle, tokens, prompt_len, params, 1, blocks, 0)
        plan = StepPlan(step_id=10**6 + index, scheduled=[handle],
                        num_scheduled_tokens=[prompt_len], new_requests=[new])  # fmt: skip
        sync(runner.device)
        start = time.perf_counter()
        runner.launch(plan)
        launched = time.perf_counter()
        result = runner.finish()
        sync(runner.device)
        outcome[static] = (result, (launched - start) * 1e3, (time.perf_counter() - start) * 1e3)
        runner.input_batch.remove_request(handle)
    runner.static_prefill = original
    (graph, graph_launch, graph_ms), (eager, eager_launch, eager_ms) = outcome[True], outcome[False]
    assert graph is not None and eager is not None and graph.logprobs and eager.logprobs
    diff = max(
        abs(a - b) for a, b in zip(graph.logprobs[0].top_logprobs, eager.logprobs[0].top_logprobs)
    )
    step = runner.decode_step
    fits = step is not None and bool(step.graphs) and prompt_len <= step.max_batch
    same_token = graph.sampled_token_ids == eager.sampled_token_ids
    same_ids = graph.logprobs[0].top_token_ids == eager.logprobs[0].top_token_ids
    return [
        f"- prefill of {prompt_len} tokens as decode-graph rows (graph path taken: {fits}): "
        f"launch {graph_launch:.2f} ms "
        f"(host), first token {graph_ms:.2f} ms; eager prefill path: launch {eager_launch:.2f} "
        f"ms, first token {eager_ms:.2f} ms; same token: {same_token}, same top-5 ids: "
        f"{same_ids}, max |top-5 logprob diff| {diff:.3g}"
    ]


def make_runner(args: argparse.Namespace, target: Path, spec: SpeculativeConfig) -> ModelRunner:
    blocks = sum(b * cdiv(min(args.context + 700, 1024), 16) for b in args.batches)
    config = EngineConfig(
        model=str(target), load_format="dummy", device=args.device, dtype="bfloat16",
        max_model_len=1024, max_num_seqs=max(args.batches), num_kv_blocks=blocks,
        enforce_eager=args.eager, skip_tokenizer_init=True, speculative_config=spec,
    ).resolve()  # fmt: skip
    runner = ModelRunner(config)
    runner.load_model()
    startup.compile_kernels_ahead(runner)
    startup.init_kv_cache(runner, blocks)
    return runner


def anatomy(args: argparse.Namespace, runner: ModelRunner, name: str, k: int) -> list[str]:
    """Per batch size: the step times, the parts, the runtime calls and the graph checks."""
    lines, first_block = [], 0
    for batch in args.batches:
        session = SpecSession(runner, batch, args.context, first_block, k)
        first_block += session.num_blocks
        for speculate in (False, True, True, True):  # admit, warm up, first proposals
            session.step(speculate)
        plain_ms, _ = time_steps(session, False, args.iters)
        session.step(True)
        spec_ms, emitted = time_steps(session, True, args.iters)
        parts = time_parts(session, args.iters)
        calls = count_calls(session, False, 3) | count_calls(session, True, 3)
        checks = graph_checks(runner, batch, k)
        session.close()
        lines += [
            f"\n### {name}, batch {batch}\n",
            f"- plain decode step {plain_ms:.3f} ms; speculative step {spec_ms:.3f} ms "
            f"({spec_ms / max(plain_ms, 1e-9):.2f} plain steps; {k} drafts per request; "
            f"emitted {emitted:.2f} tokens/request/step: dummy weights, no meaning)",
            *[f"- graph check: {c}" for c in checks],
            "",
            "| part | ms per call (synced) | calls per step | kernel launches | graph replays "
            "| copies | host syncs |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for part, counts in calls.items():
            whole = {"plain decode step": plain_ms, "speculative step": spec_ms}
            ms, per_step = parts.get(part, (whole.get(part, float("nan")), 1.0))
            lines.append(
                f"| {part} | {ms:.3f} | {per_step:.2f} | "
                + " | ".join(f"{counts[kind]:.1f}" for kind in RUNTIME_CALLS)
                + " |"
            )
        print("\n".join(lines[-len(calls) - 8 :]), flush=True)
    return lines


def engine_configs() -> list[tuple[str, dict | None]]:
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
             "prompt_lookup_min": 2}  # fmt: skip
    return [
        ("no speculation", None),
        ("draft k=3", {"model": str(DRAFT), "num_speculative_tokens": 3}),
        ("n-gram k=4", ngram),
        ("n-gram k=4, 4 rounds", ngram | {"num_rounds": 4}),
        ("draft k=3, 4 rounds", {"model": str(DRAFT), "num_speculative_tokens": 3,
                                 "num_rounds": 4}),
    ]  # fmt: skip


def per_count(timer: dict, phase: str) -> float:
    entry = timer.get(phase, {"s": 0.0, "count": 0})
    return entry["s"] / max(entry["count"], 1) * 1e3


def steady_steps(step_log: dict) -> tuple[float, float]:
    """Worker host ms and device ms per step (StepLog), without the prefill steps (those of
    the slowest listed with more than 8 tokens: the prompts' chunks)."""
    kinds = step_log["by_kind"].values()
    steps = sum(k["steps"] for k in kinds)
    host = sum(k["host_s"] for k in kinds)
    device = sum(k["device_s"] for k in kinds)
    prefills = {r["step"]: r for r in step_log["slowest_host"] + step_log["slowest_device"]
                if r["num_tokens"] > 8}  # fmt: skip
    host -= sum(r["host_s"] for r in prefills.values())
    device -= sum(r["device_s"] for r in prefills.values())
    steady = max(steps - len(prefills), 1)
    return host / steady * 1e3, device / steady * 1e3


def engine_row(target: Path, name: str, spec: dict | None, tokens: int) -> str:
    """Batch 1 through the actors: ms per step, and the worker's and scheduler's loop phases
    per call (ProfileConfig's loop timers, over the engine's whole run)."""
    from pagedserve import LLM
    from pagedserve import SamplingParams as Params

    out = Path(tempfile.mkdtemp(prefix="spec_anatomy_"))
    extra = {} if spec is None else {"speculative_config": spec}
    profile = ProfileConfig(output_dir=str(out), first_step=10**9, num_steps=0)
    prompt = " ".join(["the king is dead, long live the king;"] * 12)
    params = Params(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    with LLM(str(target), load_format="dummy", max_model_len=1024, max_num_seqs=64,
             profile=profile, **extra) as llm:  # fmt: skip
        llm.generate([prompt], Params(temperature=0.0, max_tokens=16), use_tqdm=False)
        before = llm.get_stats()
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = llm.get_stats()
    steps = max(after.num_steps - before.num_steps, 1)
    emitted = after.num_generation_tokens - before.num_generation_tokens
    worker = json.loads((out / "worker0.loop.json").read_text())
    scheduler = json.loads((out / "scheduler.loop.json").read_text())
    host_ms, device_ms = steady_steps(json.loads((out / "worker0.steps.json").read_text()))
    ms = wall / steps * 1e3
    return (
        f"| {name} | {ms:.3f} | {emitted / steps:.2f} | {wall / max(emitted, 1) * 1e3:.3f} | "
        f"{host_ms:.3f} | {device_ms:.3f} | {per_count(worker, 'finish'):.3f} | "
        f"{ms - host_ms:.3f} | {per_count(scheduler, 'handle'):.3f} | "
        f"{per_count(scheduler, 'plan'):.3f} | {per_count(scheduler, 'send_outputs'):.3f} |"
    )


def engine_section(target: Path, tokens: int) -> list[str]:
    lines = [
        f"\n## Engine level: batch 1, {tokens} greedy tokens through the actors\n",
        "ms/step: the measured generate's wall time per engine step. Worker launch and "
        "device per step: the StepLog's steady steps (prefills left out; device: from one "
        "step's start on the stream to the next, idle included). A speculative step runs to "
        "completion inside its launch, so for it 'outside the launch' (ms/step less the "
        "launch) is the round trip through the sockets and the scheduler; a plain step is "
        "pipelined (that difference means little). Loop-timer columns (worker finish, "
        "scheduler phases): ms per call over the engine's whole run.\n",
        "| config | ms/step | tokens/step | ms/token | worker launch | device "
        "| worker finish | outside the launch | sched. handle | sched. plan | sched. send |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, spec in engine_configs():
        try:
            lines.append(engine_row(target, name, spec, tokens))
        except Exception as error:  # one failing config leaves the others' rows
            lines.append(f"| {name} | failed: {type(error).__name__}: {error} |")
        print(lines[-1], flush=True)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--engine-tokens", type=int, default=128)
    parser.add_argument("--no-engine", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    target = target_dir(Path(tempfile.mkdtemp(prefix="target_94m_")))
    lines = [
        f"# Speculative-step anatomy ({datetime.datetime.now():%Y-%m-%d %H:%M}, {args.device})\n",
        f"command: `python scripts/gpu/spec_anatomy.py {' '.join(sys.argv[1:])}` at "
        f"{git_revision()}\n",
        "Target: the `target` preset (20 x 640, dummy weights, bf16); draft: the embedded 4M "
        f"model. Context {args.context} tokens; medians of {args.iters} steps.",
    ]
    started = time.perf_counter()
    methods = [
        ("draft k=3", SpeculativeConfig(model=str(DRAFT), num_speculative_tokens=3), 3),
        ("n-gram k=4", SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                         prompt_lookup_max=4, prompt_lookup_min=2), 4),
    ]  # fmt: skip
    for name, spec, k in methods:
        runner = make_runner(args, target, spec)
        lines.append(f"\n{name}: start-up phases (s) {runner.setup_seconds}")
        lines += anatomy(args, runner, name, k)
        lines.append(scheduled_steps(runner, args.engine_tokens))
        lines += prefill_check(runner)
        print("\n".join(lines[-2:]), flush=True)
        runner.close()
        del runner
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if not args.no_engine:
        lines += engine_section(target, args.engine_tokens)
    lines.append(f"\ntotal {time.perf_counter() - started:.0f} s")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
