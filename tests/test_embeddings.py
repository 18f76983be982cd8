"""Embeddings (vLLM's pooling API): `LLM.embed`, `POST /v1/embeddings` and the engine path under
them. transformers is the oracle: an embedding is the model's last hidden state (after the final
norm) pooled as the engine's pooler_config says (LAST: the last prompt token's, MEAN: the mean
over the prompt, CLS: the first token's), cut to `dimensions` and normalized to unit length
unless told otherwise; the engine computes it through chunked prefill, the prefix cache,
preemption and restarted workers, and never shows a token for it."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import time
from pathlib import Path

import httpx2 as httpx
import numpy as np
import openai
import pytest

from pagedserve import LLM, LoRARequest, PoolingParams, SamplingParams
from pagedserve.actors.messages import (
    AddRequest,
    FinishReason,
    NewRequestData,
    RequestDelta,
    StepPlan,
    StepResult,
)
from pagedserve.actors.pooling_params import pooling_sampling
from pagedserve.actors.scheduler.scheduler import Scheduler
from pagedserve.actors.supervisor import Supervisor
from pagedserve.actors.worker import startup
from pagedserve.actors.worker.model_runner import ModelRunner
from pagedserve.api.cli import build_parser
from pagedserve.api.client import Client
from pagedserve.api.client_core import EngineRequestError
from pagedserve.api.engine_args import engine_kwargs
from pagedserve.config import EngineConfig, PoolerConfig, ServerConfig
from pagedserve.outputs import embedding_floats
from tests.engine_settings import NO_STANDBY
from tests.test_openai_server import free_port, running_server
from tests.tiny_models import (
    hf_embedding,
    hf_greedy,
    load_hf_model,
    merge_lora,
    random_prompts,
    record_tokenizer_class,
    save_lora_adapter,
    save_tiny_model,
)

HIDDEN_SIZE = 64  # save_tiny_model's
ATOL = 1e-5  # float32 on both sides
# inside a block, on block edges, and prompts longer than the token budget (several chunks)
PROMPT_LENGTHS = [1, 5, 16, 17, 40, 90]
# max_num_batched_tokens (with max_num_seqs no larger, which it would raise it to): the 40- and
# 90-token prompts are prefilled in chunks
BUDGET = 32
CHUNKED = {"max_num_batched_tokens": BUDGET, "max_num_seqs": 8}
MAX_MODEL_LEN = 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "To be?"}]
# for an engine whose test sends token ids and checks vectors only (no delta's text): no
# tokenizer, whose load is most of an engine's start-up here
TOKEN_IDS = {"skip_tokenizer_init": True}


def assert_close(got: list[float], expected: list[float]) -> None:
    assert got == pytest.approx(expected, abs=ATOL)


def run_together(
    client: Client, generate: list[list[int]], embed: list[list[int]]
) -> tuple[list[list[RequestDelta]], list[list[RequestDelta]]]:
    """Greedy generations and embeddings submitted at once, in turns, on one client: each
    request's deltas (generations', then embeddings')."""
    seqs: dict[str, list[int]] = {"generate": [], "embed": []}
    for index in range(max(len(generate), len(embed))):
        if index < len(generate):
            seqs["generate"].append(client.submit(generate[index], GREEDY))
        if index < len(embed):
            pooled = client.submit(embed[index], pooling_sampling(), pooling=PoolingParams())
            seqs["embed"].append(pooled)
    deltas: dict[int, list[RequestDelta]] = {seq: [] for seq in sum(seqs.values(), [])}
    while any(not d or d[-1].finish_reason is None for d in deltas.values()):
        delta = client.receive(timeout_ms=30_000)
        assert isinstance(delta, RequestDelta) and delta.seq in deltas, delta
        deltas[delta.seq].append(delta)
    return [deltas[s] for s in seqs["generate"]], [deltas[s] for s in seqs["embed"]]


def tokens_of(deltas: list[RequestDelta]) -> list[int]:
    return [token for delta in deltas for token in delta.token_ids]


def vector_of(deltas: list[RequestDelta]) -> list[float]:
    """An embedding request's vector: its one delta's, which has no token and no text."""
    (delta,) = deltas
    assert not delta.token_ids and not delta.text and delta.finish_reason is not None
    assert delta.embedding is not None
    return embedding_floats(delta.embedding)


def add_sentence_transformers_layout(path: Path, pooling_mode: str, normalize: bool) -> Path:
    """modules.json (Transformer, Pooling, and Normalize when asked) and the Pooling module's
    config.json with `pooling_mode` on, as sentence-transformers saves a model."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
    ]  # fmt: skip
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize",
             "type": "sentence_transformers.models.Normalize"}
        )  # fmt: skip
    (path / "modules.json").write_text(json.dumps(modules))
    modes = ["cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken"]
    settings = {"word_embedding_dimension": HIDDEN_SIZE}
    settings |= {f"pooling_mode_{mode}": f"pooling_mode_{mode}" == pooling_mode for mode in modes}
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(settings | {"include_prompt": True}))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embeddings")
    return {arch: save_tiny_model(arch, root / arch) for arch in ("llama", "qwen3")}


@pytest.fixture(scope="module")
def mean_model(models, tmp_path_factory) -> Path:
    """The Llama with a sentence-transformers layout of mean pooling and no Normalize."""
    path = tmp_path_factory.mktemp("st") / "llama"
    shutil.copytree(models["llama"], path)
    record_tokenizer_class(path)  # a new directory: mean_engine's actors find its record
    return add_sentence_transformers_layout(path, "pooling_mode_mean_tokens", normalize=False)


@pytest.fixture(scope="module")
def mean_engine(mean_model: Path):
    with LLM(
        str(mean_model), **CHUNKED, num_kv_blocks=128,
        max_model_len=MAX_MODEL_LEN, supervision=NO_STANDBY,
    ) as llm:  # fmt: skip
        yield llm


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_embeddings_equal_transformers_pooled_hidden_states(
    models, arch: str, pooling_type: str
) -> None:
    """Every length, chunked prefill included (MEAN sums its chunks), with the prefix cache on:
    the prompts again (and one twice in a batch) give the same vectors; LAST requests start
    from cached blocks, MEAN and CLS ones take none (positions they need would not run). No
    token is shown, the prompt's ids come back, and every KV block is free afterwards."""
    prompts = random_prompts(400, PROMPT_LENGTHS, seed=1)
    model = load_hf_model(models[arch])
    expected = [hf_embedding(model, prompt, pooling_type) for prompt in prompts]
    with LLM(
        str(models[arch]), **CHUNKED, num_kv_blocks=128,
        pooler_config={"pooling_type": pooling_type}, supervision=NO_STANDBY, **TOKEN_IDS,
    ) as llm:  # fmt: skip
        first = llm.embed(prompts)
        before = llm.get_stats()
        again = llm.embed(prompts + [prompts[-1]])
        after = llm.get_stats()
        assert not llm.supervisor.restarts
    for prompt, vector, output in zip(prompts + [prompts[-1]], expected + [expected[-1]], again):
        assert output.finished and output.prompt_token_ids == prompt
        assert_close(output.outputs.embedding, vector)
    for output, vector in zip(first, expected):
        assert_close(output.outputs.embedding, vector)
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    assert hits > 0 if pooling_type == "LAST" else hits == 0
    assert after.num_generation_tokens == 0
    assert after.num_free_blocks == after.num_total_blocks


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_embeddings_across_tensor_and_pipeline_parallel_workers(models, layout: dict) -> None:
    """Two workers: the hidden states are whole on each tensor-parallel rank; with two stages
    the last one pools (and reports). MEAN over chunked prompts, as one worker gives it."""
    prompts = random_prompts(400, [90, 7, 40], seed=7)
    model = load_hf_model(models["llama"])
    with LLM(
        str(models["llama"]), **CHUNKED, num_kv_blocks=64,
        pooler_config={"pooling_type": "MEAN"}, supervision=NO_STANDBY, **layout, **TOKEN_IDS,
    ) as llm:  # fmt: skip
        outputs = llm.embed(prompts)
        assert not llm.supervisor.restarts
    for prompt, output in zip(prompts, outputs):
        assert_close(output.outputs.embedding, hf_embedding(model, prompt, "MEAN"))


def test_an_embedding_runs_with_its_lora_adapter(models, tmp_path: Path) -> None:
    """lora_request as generate takes it: the vector of the model with the adapter merged;
    the same prompt without an adapter, in the same call, the plain model's."""
    adapter = save_lora_adapter(models["llama"], tmp_path / "adapter", seed=1)
    prompt = random_prompts(400, [40], seed=8)[0]
    lora = LoRARequest("a", 1, str(adapter))
    with LLM(
        str(models["llama"]), **CHUNKED, num_kv_blocks=64, enable_lora=True,
        supervision=NO_STANDBY, **TOKEN_IDS,
    ) as llm:  # fmt: skip
        adapted, plain = llm.embed([prompt, prompt], lora_request=[lora, None])
    merged, base = merge_lora(models["llama"], adapter), load_hf_model(models["llama"])
    assert_close(adapted.outputs.embedding, hf_embedding(merged, prompt, "LAST"))
    assert_close(plain.outputs.embedding, hf_embedding(base, prompt, "LAST"))
    assert adapted.outputs.embedding != pytest.approx(plain.outputs.embedding, abs=1e-3)


def test_the_models_sentence_transformers_layout_chooses_the_default_pooling(
    mean_engine: LLM, models
) -> None:
    """Mean pooling without Normalize, as the model directory says; PoolingParams override
    normalize and cut the vector (Matryoshka: its first `dimensions` values, then normalized),
    per prompt; truncate_prompt_tokens keeps the prompt's last tokens."""
    chosen = mean_engine.supervisor.config.pooler_config
    assert chosen == PoolerConfig(pooling_type="MEAN", normalize=False)
    model = load_hf_model(models["llama"])
    prompt = random_prompts(400, [50], seed=2)[0]
    params = [
        PoolingParams(),
        PoolingParams(normalize=True),
        PoolingParams(dimensions=8),
        PoolingParams(dimensions=8, normalize=True),
    ]
    outputs = mean_engine.embed([prompt] * 4, params)
    assert_close(outputs[0].outputs.embedding, hf_embedding(model, prompt, "MEAN", False))
    assert_close(outputs[1].outputs.embedding, hf_embedding(model, prompt, "MEAN", True))
    assert_close(outputs[2].outputs.embedding, hf_embedding(model, prompt, "MEAN", False, 8))
    assert_close(outputs[3].outputs.embedding, hf_embedding(model, prompt, "MEAN", True, 8))
    assert outputs[3].outputs.hidden_size == 8
    truncated = mean_engine.embed(prompt, truncate_prompt_tokens=5)[0]
    assert truncated.prompt_token_ids == prompt[-5:]
    assert_close(truncated.outputs.embedding, hf_embedding(model, prompt[-5:], "MEAN", False))


def test_bad_pooling_requests_are_refused_and_the_engine_keeps_serving(mean_engine: LLM) -> None:
    """dimensions beyond the hidden size, and prompts longer than max_model_len, are 400s; a
    prompt of exactly max_model_len tokens fits (an embedding needs no room for output)."""
    with pytest.raises(ValueError, match="dimensions must be at least 1"):
        PoolingParams(dimensions=0)
    with pytest.raises(EngineRequestError, match="hidden size, 64") as refused:
        mean_engine.embed([5, 6, 7], PoolingParams(dimensions=HIDDEN_SIZE + 1))
    assert refused.value.status_code == 400
    with pytest.raises(EngineRequestError, match="maximum context length is 128"):
        mean_engine.embed([[7] * (MAX_MODEL_LEN + 1)])
    longest = mean_engine.embed([[7] * MAX_MODEL_LEN])[0]
    assert len(longest.prompt_token_ids) == MAX_MODEL_LEN
    assert len(longest.outputs.embedding) == HIDDEN_SIZE


def test_embeddings_and_generation_share_steps_without_changing_either(
    mean_engine: LLM, models
) -> None:
    """Generation and embedding requests submitted together, so that they share steps: the
    generated tokens are transformers' greedy ones, the embeddings transformers' vectors (an
    embedding's one delta has no token and no text), and every KV block is free afterwards."""
    model = load_hf_model(models["llama"])
    prompts = random_prompts(400, [3, 40, 17, 70, 1, 33], seed=3)
    generated, embedded = run_together(mean_engine.client, prompts[::2], prompts[1::2])
    for prompt, deltas in zip(prompts[::2], generated):
        assert tokens_of(deltas) == hf_greedy(model, prompt, GREEDY.max_tokens)[0]
        assert all(delta.embedding is None for delta in deltas)
    for prompt, deltas in zip(prompts[1::2], embedded):
        assert_close(vector_of(deltas), hf_embedding(model, prompt, "MEAN", normalize=False))
    stats = mean_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_preempted_pooling_requests_are_recomputed(models) -> None:
    """A KV cache too small for every request at once: requests are preempted mid-prompt (a
    MEAN request starts its sum again) and still give transformers' vectors and tokens."""
    prompts = random_prompts(400, [90, 60, 75, 40, 85, 50, 70, 30], seed=4)
    model = load_hf_model(models["llama"])
    with LLM(
        str(models["llama"]), num_kv_blocks=12, **CHUNKED,
        enable_prefix_caching=False, pooler_config={"pooling_type": "MEAN"},
        supervision=NO_STANDBY,
    ) as llm:  # fmt: skip
        generated, embedded = run_together(llm.client, prompts[:2], prompts[2:])
        stats = llm.get_stats()
    assert stats.num_preemptions > 0
    for prompt, deltas in zip(prompts[:2], generated):
        assert tokens_of(deltas) == hf_greedy(model, prompt, GREEDY.max_tokens)[0]
    for prompt, deltas in zip(prompts[2:], embedded):
        assert_close(vector_of(deltas), hf_embedding(model, prompt, "MEAN"))
    assert stats.num_free_blocks == stats.num_total_blocks


# ---------------------------------------------------------------- the scheduler


def pooling_request(seq: int, prompt: list[int], **fields) -> AddRequest:
    return AddRequest(
        client=b"client", seq=seq, prompt_token_ids=prompt, sampling=pooling_sampling(),
        eos_token_ids=[0], pooling=PoolingParams(), **fields,
    )  # fmt: skip


def pooled_result(plan: StepPlan | None, pooled: dict[int, bytes]) -> StepResult:
    """The result of a plan that samples nothing, with these requests' vectors."""
    assert plan is not None
    return StepResult(step_id=plan.step_id, handles=[], sampled_token_ids=[], pooled=pooled)


def test_the_scheduler_finishes_a_pooling_request_with_its_vector() -> None:
    """Its prompt is scheduled in chunks and nothing after it; the vector in the result of
    the step that ends the prompt finishes it (stop, no token) and frees its blocks; its route,
    asked for again (a client resubmitting), carries the vector. A request aborted before its
    vector comes ends with the abort only."""
    config = EngineConfig(max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4)
    sched = Scheduler(config, num_kv_blocks=8)
    handle = sched.add_request(pooling_request(1, list(range(2, 22)))).handle
    first, last = sched.schedule(), sched.schedule()
    assert first is not None and last is not None
    assert first.num_scheduled_tokens + last.num_scheduled_tokens == [16, 4]
    assert sched.schedule() is None  # its vector is in flight: nothing more to compute
    assert sched.update_from_result(pooled_result(first, {})) == []
    (output,) = sched.update_from_result(pooled_result(last, {handle: b"v"}))
    assert (output.handle, output.new_token_ids, output.pooled) == (handle, [], b"v")
    assert output.finish_reason is FinishReason.STOP
    assert sched.block_manager.num_free_blocks == 8 and not sched.requests
    assert sched.counters.num_generation_tokens == 0
    assert sched.add_request(pooling_request(1, list(range(2, 22)))).pooled == b"v"
    aborted = sched.add_request(pooling_request(2, [5, 6, 7])).handle
    plan = sched.schedule()
    assert plan is not None and plan.finished == [handle]  # the workers drop the finished one
    (abort,) = sched.abort_requests(b"client", [2])
    assert abort.finish_reason is FinishReason.ABORT and abort.pooled is None
    assert sched.update_from_result(pooled_result(plan, {aborted: b"w"})) == []


def test_the_scheduler_refuses_what_an_embedding_cannot_be() -> None:
    """An embedding needs no room for output (a prompt may fill max_model_len), resumes no
    tokens, and is not served by an engine with speculative decoding."""
    config = EngineConfig(max_model_len=16)
    sched = Scheduler(config, num_kv_blocks=8)
    assert sched.add_request(pooling_request(1, [5] * 16)).prompt_token_ids == [5] * 16
    refused = sched.add_request(pooling_request(2, [5] * 17))
    assert "maximum context length is 16" in refused.message
    refused = sched.add_request(pooling_request(3, [5], resume_token_ids=[6]))
    assert "no output tokens to resume" in refused.message
    ngram = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    refused = Scheduler(ngram, num_kv_blocks=8).add_request(pooling_request(4, [5]))
    assert "without speculative decoding" in refused.message


# ---------------------------------------------------------------- the worker's static paths


def test_a_pooling_step_never_takes_the_static_paths(
    models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose lone prompt chunks and decode-sized steps would run on its graphs (as on
    a GPU) runs a pooling request's chunks on the general path, whose hidden states it pools:
    a 1-token prompt, a 7-token one, and 40 tokens in chunks of 16, 16, 7 and 1."""
    config = EngineConfig(
        model=str(models["qwen3"]), num_kv_blocks=64, max_num_seqs=8,
        prefill_graph_sizes=(16, 32), pooler_config={"pooling_type": "MEAN"},
    )  # fmt: skip
    runner = ModelRunner(config.resolve())
    runner.load_model()
    startup.init_kv_cache(runner, 64)
    runner.prefill_step = runner.new_prefill_step()  # as startup.py sets them on a GPU
    runner.static_prefill = True
    assert runner.decode_step is not None
    static_calls: list[str] = []
    monkeypatch.setattr(runner, "run_prefill", lambda *a: static_calls.append("prefill"))
    monkeypatch.setattr(runner, "run_decode", lambda *a: static_calls.append("decode"))
    model = load_hf_model(models["qwen3"])
    cases = [([1], 1), ([7], 2), ([16, 16, 7, 1], 3)]
    for chunks, handle in cases:
        prompt = random_prompts(400, [sum(chunks)], seed=handle)[0]
        blocks = list(range(4 * handle, 4 * handle + 4))
        new = NewRequestData(
            handle, prompt, len(prompt), pooling_sampling(), 0, blocks, 0, None, PoolingParams()
        )
        computed, pooled = 0, {}
        for step, chunk in enumerate(chunks):
            plan = StepPlan(
                step_id=10 * handle + step, new_requests=[new] if step == 0 else [],
                scheduled=[handle], num_scheduled_tokens=[chunk],
            )  # fmt: skip
            if step:
                plan.cached_requests.num_computed_tokens = [computed]
                plan.cached_requests.num_new_blocks = [0]
            result = runner.execute(plan)
            assert not result.handles and not result.sampled_token_ids  # it never samples
            computed += chunk
            pooled |= result.pooled
        assert list(pooled) == [handle]
        assert_close(embedding_floats(pooled[handle]), hf_embedding(model, prompt, "MEAN"))
    assert not static_calls


# ---------------------------------------------------------------- supervision


@pytest.fixture(scope="module")
def supervised(models):
    config = EngineConfig(
        model=str(models["llama"]), num_kv_blocks=256, max_num_batched_tokens=16, max_num_seqs=8,
        pooler_config={"pooling_type": "MEAN"}, **TOKEN_IDS,
    )  # fmt: skip
    supervisor = Supervisor(config)
    supervisor.start()
    try:
        yield supervisor
    finally:
        supervisor.stop()


@pytest.mark.parametrize("victim", ["worker", "detokenizer"])
def test_an_actor_killed_mid_embeddings_loses_no_embedding(supervised, models, victim) -> None:
    """kill -9 of the workers (every request in flight recomputed from its first token) or of
    the detokenizer (clients resubmit; a request finished meanwhile is answered with its
    vector again) while 24 chunked MEAN embeddings run: every one still ends with its vector."""
    prompts = random_prompts(400, [120, 100] * 12, seed=5)
    model = load_hf_model(models["llama"])
    restarts = supervised.restarts.get(victim, 0)
    vectors: dict[int, list[float]] = {}
    with Client(supervised.addresses.engine_address, connect_timeout_s=30) as client:
        embeds = {client.submit(p, pooling_sampling(), pooling=PoolingParams()): p for p in prompts}
        killed_with = None
        deadline = time.monotonic() + 90
        while len(vectors) < len(embeds):
            assert time.monotonic() < deadline, f"{len(vectors)} of {len(embeds)} embeddings"
            delta = client.receive(timeout_ms=1000)
            if delta is None:
                continue
            assert delta.embedding is not None, delta
            vectors[delta.seq] = embedding_floats(delta.embedding)
            if killed_with is None:
                killed_with = len(vectors)
                os.kill(supervised.processes[victim].pid, signal.SIGKILL)
    assert supervised.restarts.get(victim, 0) == restarts + 1
    assert killed_with is not None and killed_with < len(embeds)  # the rest came after it
    for seq, prompt in embeds.items():
        assert_close(vectors[seq], hf_embedding(model, prompt, "MEAN"))


# ---------------------------------------------------------------- configuration


def test_the_pooler_config_comes_from_the_flag_the_model_or_vllms_default(
    models, tmp_path: Path
) -> None:
    """--pooler-config (any case) over the model's sentence-transformers layout over LAST with
    normalize; a pooling pagedserve does not implement, or a bad value, fails at start."""

    def resolved(path: Path, **settings) -> PoolerConfig:
        return EngineConfig(model=str(path), **settings).resolve().pooler_config

    assert resolved(models["llama"]) == PoolerConfig(pooling_type="LAST", normalize=True)
    layout = tmp_path / "st"
    shutil.copytree(models["llama"], layout)
    add_sentence_transformers_layout(layout, "pooling_mode_cls_token", normalize=True)
    assert resolved(layout) == PoolerConfig(pooling_type="CLS", normalize=True)
    add_sentence_transformers_layout(layout, "pooling_mode_lasttoken", normalize=False)
    assert resolved(layout) == PoolerConfig(pooling_type="LAST", normalize=False)
    flags = ["serve", "--pooler-config", '{"pooling_type": "mean"}']
    given = engine_kwargs(build_parser().parse_args(flags))
    assert resolved(layout, **given) == PoolerConfig(pooling_type="MEAN", normalize=False)
    add_sentence_transformers_layout(layout, "pooling_mode_max_tokens", normalize=True)
    with pytest.raises(ValueError, match="max_tokens.*--pooler-config"):
        resolved(layout)
    override = {"pooling_type": "CLS"}
    assert resolved(layout, pooler_config=override).pooling_type == "CLS"
    for bad, message in [
        ({"pooling_type": "MAX"}, "pooling_type must be one of LAST, MEAN, CLS"),
        ({"pooling_type": "LAST", "norm": True}, "unknown field `norm`"),
        ({"normalize": "yes"}, "Expected `bool"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(pooler_config=bad)


# ---------------------------------------------------------------- the HTTP server


@pytest.fixture(scope="module")
def server(models):
    port = free_port()
    config = EngineConfig(
        model=str(models["llama"]), max_model_len=MAX_MODEL_LEN, num_kv_blocks=128,
        **CHUNKED, supervision=NO_STANDBY,
        server=ServerConfig(port=port, served_model_name="tiny", max_prompts_per_request=8),
    )  # fmt: skip
    with running_server(config) as base:
        yield base


def test_the_openai_client_gets_embeddings_in_base64_and_in_floats(server, models) -> None:
    """The official client asks for base64 by default (and decodes it); floats when told. Both
    are transformers' vectors (LAST, normalized: the default for a decoder model), in input
    order, with the inputs' tokens as usage; `dimensions` cuts the vector before normalizing."""
    api = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    model = load_hf_model(models["llama"])
    prompts = random_prompts(400, [3, 40, 17], seed=6)
    expected = [hf_embedding(model, prompt, "LAST") for prompt in prompts]
    default = api.embeddings.create(model="tiny", input=prompts)
    floats = api.embeddings.create(model="tiny", input=prompts, encoding_format="float")
    for answer in (default, floats):
        assert answer.model == "tiny" and [d.index for d in answer.data] == [0, 1, 2]
        for item, vector in zip(answer.data, expected):
            assert_close(item.embedding, vector)
        assert answer.usage.prompt_tokens == answer.usage.total_tokens == 60
    cut = api.embeddings.create(model="tiny", input=prompts[1], dimensions=8)
    assert_close(cut.data[0].embedding, hf_embedding(model, prompts[1], "LAST", dimensions=8))
    text = api.embeddings.create(model="tiny", input="To be, or not", encoding_format="float")
    ids = httpx.post(server + "/tokenize", json={"prompt": "To be, or not"}).json()["tokens"]
    assert text.usage.prompt_tokens == len(ids)
    assert_close(text.data[0].embedding, hf_embedding(model, ids, "LAST"))


def test_the_embeddings_answer_has_openais_shape(server) -> None:
    body = {"model": "tiny", "input": ["a b", "c"], "encoding_format": "base64", "user": "me"}
    answer = httpx.post(server + "/v1/embeddings", json=body).json()
    assert answer["id"].startswith("embd-") and answer["object"] == "list"
    assert isinstance(answer["created"], int) and answer["model"] == "tiny"
    assert set(answer["usage"]) == {"prompt_tokens", "total_tokens"}
    for index, item in enumerate(answer["data"]):
        assert item["object"] == "embedding" and item["index"] == index
        vector = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        assert vector.shape == (HIDDEN_SIZE,) and np.linalg.norm(vector) == pytest.approx(1)


@pytest.mark.parametrize(
    "body, message",
    [
        ({"input": []}, "input must not be empty"),
        ({"input": ""}, "the prompt is empty"),
        ({"input": [[]]}, "must not be empty"),
        ({"input": "x", "dimensions": 0}, "dimensions must be at least 1"),
        ({"input": "x", "dimensions": HIDDEN_SIZE + 1}, "hidden size"),
        ({"input": [[5] * (MAX_MODEL_LEN + 1)]}, "maximum context length"),
        ({"input": "x" * 100_000}, "maximum context length"),
        ({"input": 5}, "Expected `str | array | null`"),
        ({"input": [[1], "a"]}, "input must be a string"),
        ({"input": [400_000]}, "token ids must be in"),
        ({"input": ["a"] * 9}, "at most 8 prompts"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format must be float or base64"),
        ({"input": "x", "dimensions": "8"}, "Expected `int"),
        ({}, "give either input or messages"),
        ({"input": "x", "messages": CHAT}, "give either input or messages"),
        ({"messages": []}, "messages must not be empty"),
        (
            {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True},
            "Cannot set both",
        ),
        ({"messages": CHAT, "chat_template": "{{ messages }}"}, "chat_template is not supported"),
        ({"messages": CHAT, "chat_template_kwargs": {"messages": 1}}, "may not set messages"),
        ({"messages": [{"role": "user", "content": "x" * 100_000}]}, "maximum context length"),
    ],
)
def test_bad_embedding_requests_are_400s(server, body: dict, message: str) -> None:
    reply = httpx.post(server + "/v1/embeddings", json={"model": "tiny", **body})
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]["message"]


def test_chat_messages_are_embedded_through_the_chat_template(server, models) -> None:
    """vLLM's chat form of the body: one embedding of the conversation, rendered by the chat
    template as /tokenize renders it (vLLM's defaults: no generation prompt, no special tokens
    beyond the template's), with the template's fields."""
    model = load_hf_model(models["llama"])
    renderings = set()
    for fields in ({}, {"add_generation_prompt": True}, {"continue_final_message": True}):
        body = {"model": "tiny", "messages": CHAT, "encoding_format": "float", **fields}
        answer = httpx.post(server + "/v1/embeddings", json=body).json()
        shown = {"add_generation_prompt": False, **fields}
        ids = httpx.post(server + "/tokenize", json={"messages": CHAT, **shown}).json()["tokens"]
        assert len(answer["data"]) == 1 and answer["usage"]["prompt_tokens"] == len(ids)
        assert_close(answer["data"][0]["embedding"], hf_embedding(model, ids, "LAST"))
        renderings.add(tuple(ids))
    assert len(renderings) == 3


def test_an_unknown_model_is_a_404_and_a_full_length_input_fits(server) -> None:
    unknown = httpx.post(server + "/v1/embeddings", json={"model": "nope", "input": "x"})
    assert unknown.status_code == 404
    full = httpx.post(server + "/v1/embeddings", json={"input": [[5] * MAX_MODEL_LEN]})
    assert full.status_code == 200 and full.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN
