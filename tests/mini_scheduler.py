"""Driving a ModelRunner with hand-built StepPlans (test_model_parity.py's mini scheduler) and
the tiny models' shared settings, for the model parity tests. Kept free of transformers and of
the test modules: the two ranks of a tensor-parallel test (`tensor_parallel_worker`, started
by torch.multiprocessing's spawn) import this module, not the test module, so each skips
seconds of imports."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedserve.actors.messages import NewRequestData, SamplingParams, StepPlan
from pagedserve.actors.worker import startup
from pagedserve.actors.worker.model_runner import ModelRunner
from pagedserve.config import EngineConfig
from pagedserve.kernels.attention_metadata import cdiv

BLOCK_SIZE = 16
NUM_BLOCKS = 64
MAX_NEW_TOKENS = 32
PROMPT_LENGTHS = [5, 17, 33, 1, 48, 9, 23, 60]
ARRIVAL_STEP = [0, 0, 0, 0, 0, 0, 2, 3]
CHUNKED = {7: 24}  # request 7's prefill is split into chunks of 24 tokens
COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.15,  # peaked logits: greedy has no near-ties
)


def make_runner(path: Path, **overrides: object) -> ModelRunner:
    settings: dict[str, object] = {"num_kv_blocks": NUM_BLOCKS, "max_num_seqs": 16, **overrides}
    config = EngineConfig(model=str(path), **settings)  # type: ignore[arg-type]
    runner = ModelRunner(config.resolve())
    runner.load_model()
    startup.init_kv_cache(runner, startup.num_kv_blocks(runner))
    return runner


@dataclass
class Request:
    handle: int
    tokens: list[int]
    arrival: int
    chunk: int | None
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sent: bool = False
    finished: bool = False


class MiniScheduler:
    """Just enough scheduling to drive a ModelRunner: every arrived request runs each step
    (prefill, chunked prefill or decode), blocks come from a shuffled pool."""

    def __init__(self, prompts: list[list[int]], params: SamplingParams) -> None:
        self.params = params
        self.requests = [
            Request(i, list(p), ARRIVAL_STEP[i], CHUNKED.get(i)) for i, p in enumerate(prompts)
        ]
        self.free_blocks = list(range(NUM_BLOCKS))
        random.Random(0).shuffle(self.free_blocks)
        self.step_id = 0

    def done(self) -> bool:
        return all(r.finished for r in self.requests)

    def plan(self) -> StepPlan:
        """The requests the worker holds first (the plan's wire form), then new ones."""
        plan = StepPlan(step_id=self.step_id)
        cached: list[tuple[int, int, int, list[int]]] = []  # handle, tokens, computed, blocks
        new: list[tuple[int, int]] = []  # handle, tokens
        for request in self.requests:
            if request.finished or request.arrival > self.step_id:
                continue
            if len(request.outputs) == MAX_NEW_TOKENS:
                request.finished = True
                plan.finished.append(request.handle)
                continue
            self._schedule(request, plan, cached, new)
        if self.step_id % 2:  # the batch order is the plan's, not the arrival order
            cached.reverse()
            new.reverse()
        for handle, num_tokens, computed, new_blocks in cached:
            plan.cached_requests.num_computed_tokens.append(computed)
            plan.cached_requests.num_new_blocks.append(len(new_blocks))
            plan.cached_requests.new_block_ids.extend(new_blocks)
            plan.scheduled.append(handle)
            plan.num_scheduled_tokens.append(num_tokens)
        for handle, num_tokens in new:
            plan.scheduled.append(handle)
            plan.num_scheduled_tokens.append(num_tokens)
        return plan

    def _schedule(
        self,
        request: Request,
        plan: StepPlan,
        cached: list[tuple[int, int, int, list[int]]],
        new: list[tuple[int, int]],
    ) -> None:
        num_tokens = len(request.tokens) - request.computed
        num_tokens = min(num_tokens, request.chunk or num_tokens)
        needed = cdiv(request.computed + num_tokens, BLOCK_SIZE) - len(request.blocks)
        new_blocks = [self.free_blocks.pop() for _ in range(needed)]
        request.blocks += new_blocks
        if not request.sent:
            tokens, seed = list(request.tokens), 1000 + request.handle
            data = NewRequestData(
                request.handle, tokens, len(tokens), self.params, seed, list(request.blocks), 0
            )
            plan.new_requests.append(data)
            request.sent = True
            new.append((request.handle, num_tokens))
        else:
            cached.append((request.handle, num_tokens, request.computed, new_blocks))
        request.computed += num_tokens

    def run(self, runner: ModelRunner) -> list[Request]:
        by_id = {r.handle: r for r in self.requests}
        while not self.done():
            result = runner.execute(self.plan())
            assert result.logprobs is not None or not result.handles
            for i, handle in enumerate(result.handles):
                request, logprob = by_id[handle], result.logprobs[i]  # type: ignore[index]
                assert logprob is not None
                request.tokens.append(result.sampled_token_ids[i])
                request.outputs.append(result.sampled_token_ids[i])
                request.logprobs.append(logprob.logprob)
            self.step_id += 1
        return self.requests


def random_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(COMMON["vocab_size"]) for _ in range(n)] for n in PROMPT_LENGTHS]


def tensor_parallel_worker(rank: int, path: str, init_file: str, out_file: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        runner = make_runner(Path(path), tensor_parallel_size=2)
        params = SamplingParams(temperature=0.0, logprobs=0)
        requests = MiniScheduler(random_prompts(seed=11), params).run(runner)
        if rank == 0:
            torch.save([(r.outputs, r.logprobs) for r in requests], out_file)
    finally:
        dist.destroy_process_group()
