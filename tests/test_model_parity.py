"""Hugging Face transformers is the oracle: tiny random Llama / Qwen2 / Qwen3 models driven
through ModelRunner with hand-built StepPlans must give transformers' greedy tokens, and
logprobs within LOGPROB_ATOL of transformers' log-softmax of its own logits."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve.actors.messages import (
    NewRequestData,
    SamplingParams,
    StepPlan,
)
from pagedserve.actors.worker import startup
from pagedserve.actors.worker.model_runner import ModelRunner
from pagedserve.config import EngineConfig
from pagedserve.kernels.attention_backends import torch_ref_backend
from pagedserve.models.layer_config import LayerConfig, TensorParallel
from pagedserve.models.linear import QKVParallelLinear, VocabEmbedding
from pagedserve.models.llama import model_head_dim, rope_settings
from pagedserve.models.loader import load_model
from pagedserve.models.model_config import ModelConfig, load_model_config
from tests.mini_scheduler import (
    BLOCK_SIZE,
    COMMON,
    MAX_NEW_TOKENS,
    NUM_BLOCKS,
    MiniScheduler,
    make_runner,
    random_prompts,
    tensor_parallel_worker,
)
from tests.tiny_models import hf_greedy

LOGPROB_ATOL = 1e-4  # float32 on CPU
LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=4.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
    rope_theta=5000.0,
)
YARN_ROPE = dict(  # Qwen's recipe for long contexts, at a tiny scale
    rope_type="yarn", factor=4.0, original_max_position_embeddings=32, rope_theta=10000.0
)
HF_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, rope_scaling=LLAMA3_ROPE),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False),
    "qwen3-yarn": lambda: transformers.Qwen3Config(**COMMON, head_dim=32, rope_scaling=YARN_ROPE),
}


def save_hf_model(arch: str, path: Path, **save_kwargs: object) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[arch](), dtype=torch.float32)
    model.save_pretrained(path, **save_kwargs)
    model.generation_config.eos_token_id = None  # greedy runs to max tokens
    return model.eval()


def assert_greedy_matches(
    runner: ModelRunner,
    prompts: list[list[int]],
    greedy: Callable[[list[int], int], tuple[list[int], list[float]]],
) -> None:
    """The runner's greedy tokens of each prompt (MiniScheduler, MAX_NEW_TOKENS) are those of
    `greedy(prompt, max_tokens)` (transformers'), its logprobs within LOGPROB_ATOL."""
    params = SamplingParams(temperature=0.0, logprobs=0, max_tokens=MAX_NEW_TOKENS)
    requests = MiniScheduler(prompts, params).run(runner)
    for prompt, request in zip(prompts, requests):
        expected_tokens, expected_logprobs = greedy(prompt, MAX_NEW_TOKENS)
        assert request.outputs == expected_tokens, request.handle
        torch.testing.assert_close(
            torch.tensor(request.logprobs), torch.tensor(expected_logprobs),
            atol=LOGPROB_ATOL, rtol=0,
        )  # fmt: skip


@pytest.mark.parametrize("cpu_path", ["kernels", "torch", "torch_ref"])
@pytest.mark.parametrize("arch", sorted(HF_CONFIGS))
def test_greedy_parity_with_transformers(arch: str, cpu_path: str, tmp_path: Path) -> None:
    """cpu_path: the CPU backend with its C++ kernels (when they build here), the same backend
    in pure torch, or the token-major torch reference backend."""
    overrides: dict[str, object] = {}
    if cpu_path == "torch":
        overrides["cpu_kernels"] = False
    elif cpu_path == "torch_ref":
        overrides["attention_backend"] = "torch_ref"
    hf_model = save_hf_model(arch, tmp_path)
    runner = make_runner(tmp_path, **overrides)
    prompts = random_prompts(seed=len(arch))
    assert_greedy_matches(runner, prompts, functools.partial(hf_greedy, hf_model))
    assert len(runner.input_batch) == 0  # every finished request left the persistent batch


class RecordingRunner:
    """Wraps a runner's execute to keep every plan it ran, for replaying elsewhere."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.plans = runner, []  # type: ignore[var-annotated]
        self.results = []  # type: ignore[var-annotated]

    def execute(self, plan: StepPlan) -> object:
        self.plans.append(plan)
        self.results.append(self.runner.execute(plan))
        return self.results[-1]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, logprobs=2, max_tokens=MAX_NEW_TOKENS),
        SamplingParams(temperature=0.8, top_k=20, seed=3, logprobs=0, max_tokens=MAX_NEW_TOKENS),
        SamplingParams(
            temperature=0.8, repetition_penalty=1.3, logprobs=0, max_tokens=MAX_NEW_TOKENS
        ),
    ],
    ids=["greedy-logprobs", "seeded-top-k", "penalties"],
)
def test_pipelined_steps_match_sequential_steps(tmp_path: Path, params: SamplingParams) -> None:
    """launch(N + 1) before finish(N) (the worker's pipelining: step N's sampled tokens feed
    step N + 1 on the device) gives the very results of running each step to completion."""
    save_hf_model("qwen3", tmp_path)
    recording = RecordingRunner(make_runner(tmp_path))
    MiniScheduler(random_prompts(seed=5), params).run(recording)  # type: ignore[arg-type]
    runner = make_runner(tmp_path)
    results = []
    for plan in recording.plans:
        previous = runner.launch(plan)
        assert runner.pending is not None and runner.pending.step_id == plan.step_id
        if previous is not None:
            results.append(previous)
    results.append(runner.finish())
    assert runner.pending is None and runner.finish() is None
    assert [r.step_id for r in results] == [p.step_id for p in recording.plans]
    for got, expected in zip(results, recording.results):
        assert got.handles == expected.handles
        assert got.sampled_token_ids == expected.sampled_token_ids
        assert got.logprobs == expected.logprobs
    with pytest.raises(RuntimeError, match="in flight"):
        runner.launch(recording.plans[0])  # leaves a step in flight (re-adds every request)
        runner.execute(recording.plans[1])


def test_sharded_safetensors_index(tmp_path: Path) -> None:
    save_hf_model("llama", tmp_path / "single")
    save_hf_model("llama", tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    cpu = torch.device("cpu")
    single = load_model(EngineConfig(model=str(tmp_path / "single")), cpu).state_dict()
    sharded = load_model(EngineConfig(model=str(tmp_path / "sharded")), cpu).state_dict()
    assert single.keys() == sharded.keys()
    for name, tensor in single.items():
        assert torch.equal(tensor, sharded[name]), name


@pytest.mark.parametrize("arch", sorted(HF_CONFIGS))
def test_model_config_reads_what_transformers_reads(arch: str, tmp_path: Path) -> None:
    """ModelConfig (config.json without transformers) gives the fields the models read as
    transformers' config class does, also when the file leaves defaults out."""
    hf = HF_CONFIGS[arch]()
    hf.save_pretrained(tmp_path)
    ours = load_model_config(str(tmp_path))
    bare = {"model_type": hf.model_type, "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 1, "intermediate_size": 32, "vocab_size": 16}  # fmt: skip
    sparse = ModelConfig(bare)
    reference = type(hf)(**{k: v for k, v in bare.items() if k != "model_type"})
    for config, expected in ((ours, hf), (sparse, reference)):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                     "max_position_embeddings", "tie_word_embeddings"):  # fmt: skip
            assert getattr(config, name) == getattr(expected, name), (arch, name)
        assert model_head_dim(config) == model_head_dim(expected), arch
        assert rope_settings(config) == rope_settings(expected), arch
        assert bool(getattr(config, "attention_bias", False)) == bool(
            getattr(expected, "attention_bias", False)
        )


def test_dummy_weights_are_seeded(tmp_path: Path) -> None:
    save_hf_model("qwen3", tmp_path)

    def dummy(seed: int) -> dict[str, torch.Tensor]:
        config = EngineConfig(model=str(tmp_path), load_format="dummy", seed=seed)
        return load_model(config, torch.device("cpu")).state_dict()

    first, again, other = dummy(7), dummy(7), dummy(8)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first[name], other[name])
    assert first[name].std().item() == pytest.approx(0.02, rel=0.1)
    runner = make_runner(tmp_path, load_format="dummy")
    plan = StepPlan(
        step_id=0,
        new_requests=[NewRequestData(7, [1, 2, 3], 3, SamplingParams(seed=1), 1, [5], 0)],
        scheduled=[7],
        num_scheduled_tokens=[3],
    )
    result = runner.execute(plan)
    assert result.handles == [7] and 0 <= result.sampled_token_ids[0] < 512


def test_kv_cache_sizing_and_profile_run(tmp_path: Path) -> None:
    save_hf_model("llama", tmp_path)
    config = EngineConfig(
        model=str(tmp_path), cpu_kv_cache_gib=0.01, max_num_batched_tokens=100, max_num_seqs=8
    )
    runner = ModelRunner(config.resolve())
    runner.load_model()
    per_block = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4  # layers * (k, v) * tokens * kv_heads * dim * 4B
    assert runner.bytes_per_block() == per_block
    assert startup.num_kv_blocks(runner) == int(0.01 * 2**30) // per_block
    startup.init_kv_cache(runner, startup.num_kv_blocks(runner))
    startup.profile_run(runner)  # the memory-profiling step, on CPU through the same path
    assert len(runner.input_batch) == 0


def test_eager_kernel_warm_up_leaves_the_runner_as_it_was(tmp_path: Path) -> None:
    """The start-up warm-up's synthetic mixed steps (run on CUDA by init_kv_cache) leave no
    request behind and change no later result."""
    save_hf_model("qwen3", tmp_path)
    plan = StepPlan(
        step_id=0,
        new_requests=[
            NewRequestData(7, [1, 2, 3, 4], 4, SamplingParams(temperature=1.0), 3, [5], 0)
        ],
        scheduled=[7],
        num_scheduled_tokens=[4],
    )
    expected = make_runner(tmp_path).execute(plan)
    runner = make_runner(tmp_path)
    startup.warm_up_eager_kernels(runner, NUM_BLOCKS)
    assert len(runner.input_batch) == 0 and runner.pending is None
    got = runner.execute(plan)
    assert got.sampled_token_ids == expected.sampled_token_ids and got.handles == [7]


def assert_two_ranks_match_one(model: Path, tmp_path: Path) -> None:
    """Two gloo ranks on the CPU (tensor_parallel_worker) give the model's single-process
    greedy tokens and logprobs of random_prompts(seed=11)."""
    single = MiniScheduler(random_prompts(seed=11), SamplingParams(temperature=0.0, logprobs=0))
    expected = single.run(make_runner(model))
    out_file = tmp_path / "tp_out.pt"
    torch.multiprocessing.spawn(
        tensor_parallel_worker,
        args=(str(model), str(tmp_path / "dist_init"), str(out_file)),
        nprocs=2,
    )
    for request, (outputs, logprobs) in zip(expected, torch.load(out_file)):
        assert outputs == request.outputs
        torch.testing.assert_close(
            torch.tensor(logprobs), torch.tensor(request.logprobs), atol=LOGPROB_ATOL, rtol=0
        )


def test_tensor_parallel_two_ranks_match_one(tmp_path: Path) -> None:
    """Two gloo ranks on the CPU (sharded qkv/o/gate_up/down, vocab-parallel embedding and
    LM head, one kv head per rank) give the single-process tokens and logprobs."""
    save_hf_model("qwen2", tmp_path)  # tied embeddings: the sharded embedding is the LM head
    assert_two_ranks_match_one(tmp_path, tmp_path)


def test_qkv_shard_replicates_kv_heads_beyond_their_count() -> None:
    """tp_size 4 with 2 kv heads: rank 3 holds q heads 6-7 and kv head 1 (shared with rank 2)."""
    config = LayerConfig(
        torch.device("cpu"), torch.float32, torch_ref_backend(), tp=TensorParallel(3, 4)
    )
    qkv = QKVParallelLinear(hidden_size=4, head_dim=2, num_heads=8, num_kv_heads=2, config=config)
    assert (qkv.num_heads, qkv.num_kv_heads, qkv.weight.shape[0]) == (2, 1, 8)
    full_q, full_k, full_v = (torch.arange(n * 2 * 4.0).view(n * 2, 4) for n in (8, 2, 2))
    for shard_id, full in (("q", full_q), ("k", full_k), ("v", 100 + full_v)):
        qkv.weight_loader(qkv.weight, full, shard_id)
    assert torch.equal(qkv.weight[:4], full_q[12:16])
    assert torch.equal(qkv.weight[4:6], full_k[2:4])
    assert torch.equal(qkv.weight[6:8], 100 + full_v[2:4])
    embedding = VocabEmbedding(vocab_size=10, hidden_size=2, config=config)  # 3 rows a rank
    embedding.weight_loader(embedding.weight, torch.arange(20.0).view(10, 2))
    assert embedding.weight.tolist() == [[18.0, 19.0], [0.0, 0.0], [0.0, 0.0]]
