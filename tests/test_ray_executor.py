"""The Ray executor (distributed_executor_backend="ray") on a local Ray cluster of two simulated
nodes with one CPU each: every worker is a Ray actor's process on its own node, the bus runs
over tcp and the workers meet at the supervisor's rendezvous store; tensor and pipeline
parallelism give the tokens of one rank. Ray missing or unreachable is one clear error."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedserve import LLM, SamplingParams
from tests.tiny_models import hf_greedy, load_hf_model, random_prompts, save_tiny_model

ray = pytest.importorskip("ray")

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
STORE_BYTES = 80 * 2**20  # object store per node: the executor moves only small arguments


@pytest.fixture(scope="module")
def ray_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": STORE_BYTES},
    )
    cluster.add_node(num_cpus=1, object_store_memory=STORE_BYTES)
    ray.init(address=cluster.address)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tensor-2", "pipeline-2"])
def test_workers_on_two_nodes_give_the_tokens_of_one_rank(
    ray_cluster, llama: Path, tp: int, pp: int
) -> None:
    from ray.util.placement_group import placement_group_table

    prompts = random_prompts(400, [1, 7, 17, 40], seed=21)
    with LLM(
        str(llama), tensor_parallel_size=tp, pipeline_parallel_size=pp, num_kv_blocks=64,
        max_num_batched_tokens=32, distributed_executor_backend="ray",
        skip_tokenizer_init=True,  # token ids in and out: no tokenizer to load
    ) as llm:  # fmt: skip
        executor = llm.supervisor.executor
        nodes = placement_group_table(executor.placement)["bundles_to_node_id"].values()
        assert len(set(nodes)) == 2  # one worker on each node
        assert llm.supervisor.addresses.engine_address.startswith("tcp://")
        outputs = llm.generate(prompts, GREEDY)
    model = load_hf_model(llama)
    assert [o.outputs[0].token_ids for o in outputs] == [
        hf_greedy(model, prompt, NEW_TOKENS)[0] for prompt in prompts
    ]
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU") != 2:  # the placement group is gone
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_layout_larger_than_the_cluster_is_refused(ray_cluster, llama: Path) -> None:
    with pytest.raises(ValueError, match="needs 4 workers with one CPU each; the Ray cluster"):
        LLM(str(llama), tensor_parallel_size=2, pipeline_parallel_size=2,
            distributed_executor_backend="ray")  # fmt: skip


def run_engine_start(llama: Path, prelude: str, env: dict[str, str]) -> str:
    """stderr of a fresh interpreter that starts LLM(llama, ray backend) after `prelude`."""
    code = (
        f"{prelude}\nfrom pagedserve import LLM\n"
        f"LLM({str(llama)!r}, pipeline_parallel_size=2, distributed_executor_backend='ray')"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**os.environ, **env},
    )  # fmt: skip
    assert run.returncode != 0
    return run.stderr.strip().splitlines()[-1]


def test_ray_not_installed_is_one_clear_error(llama: Path) -> None:
    last = run_engine_start(llama, "import sys; sys.modules['ray'] = None", {})
    assert last == (
        "ValueError: distributed_executor_backend='ray' needs Ray: pip install 'pagedserve[ray]'"
    )


def test_no_reachable_cluster_is_one_clear_error(llama: Path) -> None:
    last = run_engine_start(llama, "", {"RAY_ADDRESS": "127.0.0.1:9"})
    assert last.startswith("ValueError: distributed_executor_backend='ray' found no Ray cluster")
