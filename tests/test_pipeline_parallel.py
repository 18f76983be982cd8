"""Pipeline parallelism through the whole engine (`LLM`, real worker processes, gloo): a model
split into stages, alone or in a grid with tensor parallelism, gives exactly the greedy tokens
of one rank (transformers' own, which one rank matches: test_engine.py), with chunked prefill
and preemption; impossible layouts fail before any process starts; a dead rank restarts the
whole group, which finishes the work: never a hang, never a wrong token. (Standby processes
are off where no restart is tested: their imports would only slow the run on a small CPU.)"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.api.client import Client
from tests.engine_settings import NO_STANDBY
from tests.tiny_models import hf_greedy, load_hf_model, random_prompts, save_tiny_model

PROMPT_LENGTHS = [1, 3, 7, 16, 17, 33, 50, 90]
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
# 14 blocks of 16 tokens cannot hold the 8 requests at once (~290 prompt tokens + 128 output):
# requests are preempted; the 64-token budget prefills the long prompts in chunks
TIGHT = dict(num_kv_blocks=14, enable_prefix_caching=False, max_num_batched_tokens=64)
# the tests send token ids and check tokens: no tokenizer (whose load is most of a start-up)
TOKEN_IDS = dict(skip_tokenizer_init=True)


def expected_tokens(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = load_hf_model(path)
    return [hf_greedy(model, prompt, NEW_TOKENS)[0] for prompt in prompts]


@pytest.mark.parametrize(
    ("model", "tp", "pp"),
    [("llama", 1, 2), ("qwen3", 1, 2), ("llama", 2, 2), ("qwen3", 2, 2)],
    ids=[
        "llama-pipeline-2",
        "qwen3-pipeline-2",
        "llama-tensor-2-x-pipeline-2",
        "qwen3-tensor-2-x-pipeline-2",
    ],
)
def test_pipeline_stages_give_the_tokens_of_one_rank(
    tmp_path: Path, model: str, tp: int, pp: int
) -> None:
    path = save_tiny_model(model, tmp_path / model)
    prompts = random_prompts(400, PROMPT_LENGTHS, seed=11)
    expected = expected_tokens(path, prompts)
    with LLM(
        str(path), tensor_parallel_size=tp, pipeline_parallel_size=pp, supervision=NO_STANDBY,
        **TIGHT, **TOKEN_IDS,
    ) as llm:  # fmt: skip
        workers = sorted(label for label in llm.supervisor.processes if label.startswith("worker"))
        assert len(workers) == tp * pp
        outputs = llm.generate(prompts, GREEDY)
        stats = llm.get_stats()
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_an_uneven_split_with_a_middle_stage(tmp_path: Path) -> None:
    """Four layers on three stages: 1, 2 and 1 (the middle stage receives and sends)."""
    path = save_tiny_model("llama", tmp_path / "llama4", num_layers=4)
    prompts = random_prompts(400, PROMPT_LENGTHS[:5], seed=12)
    with LLM(
        str(path), pipeline_parallel_size=3, supervision=NO_STANDBY, num_kv_blocks=64,
        max_num_batched_tokens=16, **TOKEN_IDS,  # the 17-token prompt in chunks
    ) as llm:  # fmt: skip
        outputs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected_tokens(path, prompts)


def test_impossible_layouts_fail_before_any_process_starts(tmp_path: Path) -> None:
    path = str(save_tiny_model("llama", tmp_path / "llama"))  # 2 layers, 4 heads
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(ValueError, match="more stages than the model's 2 layers"):
        LLM(path, pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        LLM(path, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="speculative decoding is not supported"):
        LLM(path, pipeline_parallel_size=2, speculative_config={"num_speculative_tokens": 2})
    assert set(psutil.Process().children(recursive=True)) == before


@pytest.mark.timeout(240)
def test_a_dead_rank_restarts_the_whole_group_which_finishes_the_work(tmp_path: Path) -> None:
    path = save_tiny_model("llama", tmp_path / "llama")
    prompts = random_prompts(400, [40] * 3, seed=13)
    new_tokens = 48
    long = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm = LLM(str(path), pipeline_parallel_size=2, num_kv_blocks=256, **TOKEN_IDS)
    first_group = {label: p.pid for label, p in llm.supervisor.processes.items()}
    killed_after: list[int] = []

    def kill_mid_generation() -> None:  # watching through a client of its own
        with Client(llm.supervisor.addresses.engine_address) as probe:
            deadline = time.monotonic() + 120
            while (done := probe.stats().num_generation_tokens) < 20:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        os.kill(first_group["worker"], signal.SIGKILL)  # the first stage
        killed_after.append(done)

    killer = threading.Thread(target=kill_mid_generation)
    killer.start()
    try:
        outputs = llm.generate(prompts, long)
        restarts = llm.supervisor.restarts
        second_group = {label: p.pid for label, p in llm.supervisor.processes.items()}
    finally:
        killer.join()
        llm.shutdown()
    assert killed_after and killed_after[0] < len(prompts) * new_tokens
    assert restarts == {"worker": 1}
    for label in ("worker", "worker-1"):  # both stages are new processes
        assert second_group[label] != first_group[label]
    assert second_group["scheduler"] == first_group["scheduler"]
    model = load_hf_model(path)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(model, prompt, new_tokens)[0]
    pids = {*first_group.values(), *second_group.values()}
    assert not any(
        psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids
    )
