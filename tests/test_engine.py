"""The whole engine through the public `LLM` API: real actor processes, real sockets.

transformers is the oracle: greedy tokens must be identical and logprobs close. Engines whose
test sends token ids and checks only tokens, logprobs and counts start without the tokenizer
(skip_tokenizer_init: token ids in and out), whose load is most of an engine's start-up here.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import msgspec
import psutil
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.actors import bus
from tests.engine_settings import NO_STANDBY
from tests.tiny_models import (
    hf_greedy,
    load_hf_model,
    pick_stop_string,
    random_prompts,
    save_tiny_model,
)

PROMPT_LENGTHS = [1, 3, 7, 16, 17, 33, 50, 90]  # inside a block, on a block edge, several blocks
NEW_TOKENS = 32
LOGPROB_ATOL = 1e-3  # float32 both sides; batched vs single-sequence matmuls differ slightly
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
CHAT_TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def arch_model(request, tmp_path_factory) -> tuple[str, Path]:
    path = save_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama-shared"))


@pytest.fixture(scope="module")
def llama_engine(llama_path: Path):
    # small token budget: the 90-token prompt is prefilled in chunks; a custom chat template
    with LLM(
        str(llama_path),
        max_num_batched_tokens=64,
        num_kv_blocks=256,
        chat_template=CHAT_TEMPLATE,
        max_logprobs=25,
        supervision=NO_STANDBY,
    ) as llm:
        yield llm


def assert_matches_transformers(path: Path, prompts: list[list[int]], outputs) -> None:
    model = load_hf_model(path)
    for prompt, output in zip(prompts, outputs):
        expected_tokens, expected_logprobs = hf_greedy(model, prompt, NEW_TOKENS)
        completion = output.outputs[0]
        assert completion.token_ids == expected_tokens
        got = [next(iter(lp.values())).logprob for lp in completion.logprobs]
        assert got == pytest.approx(expected_logprobs, abs=LOGPROB_ATOL)
        assert completion.finish_reason == "length"


def test_greedy_parity_with_transformers(arch_model: tuple[str, Path]) -> None:
    arch, path = arch_model
    prompts = random_prompts(400, PROMPT_LENGTHS, seed=1)
    with LLM(
        str(path), max_num_batched_tokens=64, num_kv_blocks=128, supervision=NO_STANDBY,
        skip_tokenizer_init=True,
    ) as llm:  # fmt: skip
        outputs = llm.generate(prompts, GREEDY)
        stats = llm.get_stats()
    assert_matches_transformers(path, prompts, outputs)
    assert stats.num_free_blocks == stats.num_total_blocks


def test_prefix_cache_reuses_blocks_and_keeps_output(llama_engine: LLM) -> None:
    shared = random_prompts(400, [70], seed=2)[0]
    first = llama_engine.generate([shared + [11, 12]], GREEDY)[0]
    before = llama_engine.get_stats()
    second = llama_engine.generate([shared + [11, 12]], GREEDY)[0]
    other = llama_engine.generate([shared + [99]], GREEDY)[0]
    after = llama_engine.get_stats()
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 64  # 4 full blocks of 16 of the 72-token prompt
    assert other.num_cached_tokens == 64
    assert after.prefix_cache_hits - before.prefix_cache_hits == 128
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    expected, _ = hf_greedy(load_hf_model(llama_engine.config.model), shared + [99], NEW_TOKENS)
    assert other.outputs[0].token_ids == expected


def test_preemption_under_kv_pressure_keeps_outputs(llama_path: Path) -> None:
    prompts = random_prompts(400, PROMPT_LENGTHS, seed=3)
    # the reference: transformers' greedy tokens, one sequence at a time (no preemption, no
    # asynchronous scheduling); an engine with room for all matches them (parity test above)
    model = load_hf_model(llama_path)
    expected = [hf_greedy(model, prompt, NEW_TOKENS)[0] for prompt in prompts]
    # 14 blocks of 16 tokens cannot hold the 8 requests (~330 tokens of prompt + 256 of output)
    with LLM(
        str(llama_path), num_kv_blocks=14, enable_prefix_caching=False, supervision=NO_STANDBY,
        skip_tokenizer_init=True,
    ) as tight:  # fmt: skip
        outputs = tight.generate(prompts, GREEDY)
        stats = tight.get_stats()
    assert stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats.num_free_blocks == stats.num_total_blocks


def test_stop_strings_eos_and_max_tokens(llama_engine: LLM) -> None:
    prompt = random_prompts(400, [12], seed=4)[0]
    free = llama_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0]
    text = free.outputs[0].text
    assert len(free.outputs[0].token_ids) == 24 and free.outputs[0].finish_reason == "length"
    stop = pick_stop_string(text)
    stopped = llama_engine.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == text[: text.index(stop)]
    first_token = free.outputs[0].token_ids[3]
    by_token = llama_engine.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[first_token])
    )[0].outputs[0]
    assert by_token.token_ids == free.outputs[0].token_ids[:4]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == first_token


def test_seeded_sampling_is_reproducible_and_n_gives_several(llama_engine: LLM) -> None:
    prompt = random_prompts(400, [9], seed=5)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=16, n=3)
    a = llama_engine.generate([prompt], params)[0]
    b = llama_engine.generate([prompt, prompt[:4]], params)[0]  # another batch composition
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1
    assert [o.index for o in a.outputs] == [0, 1, 2]


def test_logit_bias_steers_greedy_and_sampled_tokens(llama_engine: LLM) -> None:
    """vLLM's logit_bias through the whole engine: +100 makes a token every greedy pick
    (in the static decode path too), -100 keeps a token out of greedy and seeded n > 1 output,
    and requests without a bias in the same batch are untouched."""
    from pagedserve.api.client_core import EngineRequestError

    prompt = random_prompts(400, [10], seed=6)[0]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = llama_engine.generate([prompt], plain)[0].outputs[0].token_ids
    forced = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={7: 100})
    both = llama_engine.generate([prompt, prompt], [forced, plain])
    assert both[0].outputs[0].token_ids == [7] * 12 and both[1].outputs[0].token_ids == free
    banned = set(free)
    ban = {t: -100.0 for t in banned}
    greedy_ban = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=ban)
    seeded_ban = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=12, ignore_eos=True,
                                logit_bias=ban)  # fmt: skip
    outputs = llama_engine.generate([prompt, prompt], [greedy_ban, seeded_ban])
    for output in outputs:
        for completion in output.outputs:
            assert len(completion.token_ids) == 12 and not banned & set(completion.token_ids)
    with pytest.raises(EngineRequestError, match="logit_bias"):
        llama_engine.generate([prompt], SamplingParams(logit_bias={10**6: 1.0}))


def test_allowed_token_ids_and_truncated_prompts_through_the_engine(llama_engine: LLM) -> None:
    """vLLM's allowed_token_ids (greedy and seeded n > 1 sample only them, beside a free
    request in the same batch) and truncate_prompt_tokens (the prompt's last k tokens: the
    same output as a request of those tokens alone)."""
    from pagedserve.api.client_core import EngineRequestError

    prompt = random_prompts(400, [30], seed=8)[0]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = llama_engine.generate([prompt], plain)[0].outputs[0].token_ids
    allowed = [7, 9, 11]
    greedy = msgspec.structs.replace(plain, allowed_token_ids=allowed)
    seeded = msgspec.structs.replace(greedy, temperature=1.0, seed=4, n=3)
    outputs = llama_engine.generate([prompt] * 3, [greedy, seeded, plain])
    assert outputs[2].outputs[0].token_ids == free
    drawn = [t for o in outputs[:2] for c in o.outputs for t in c.token_ids]
    assert len(drawn) == 48 and set(drawn) <= set(allowed) and len(set(drawn)) > 1
    with pytest.raises(EngineRequestError, match="allowed_token_ids"):
        llama_engine.generate([prompt], SamplingParams(allowed_token_ids=[10**6]))
    cut = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, truncate_prompt_tokens=5)
    truncated, tail = llama_engine.generate([prompt, prompt[-5:]], [cut, plain])
    assert truncated.prompt_token_ids == prompt[-5:]
    assert truncated.outputs[0].token_ids == tail.outputs[0].token_ids
    with pytest.raises(ValueError, match="Cannot set both"):
        llama_engine.chat([{"role": "user", "content": "x"}], continue_final_message=True)


def greedy_without(model, prompt: list[int], banned: list[list[int]], steps: int) -> list[int]:
    """transformers' greedy tokens under vLLM's bad-words rule: a sequence's last token is
    masked where the output so far (not the prompt) ends with the rest of the sequence."""
    import torch

    output: list[int] = []
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(torch.tensor([prompt + output])).logits[0, -1]
            for seq in banned:
                if len(seq) - 1 <= len(output) and output[len(output) - len(seq) + 1 :] == seq[:-1]:
                    logits[seq[-1]] = float("-inf")
            output.append(int(logits.argmax()))
    return output


def contains(tokens: list[int], seq: list[int]) -> bool:
    return any(tokens[i : i + len(seq)] == seq for i in range(len(tokens) - len(seq) + 1))


def test_bad_words_keep_their_token_sequences_out_of_the_output(
    llama_engine: LLM, llama_path: Path
) -> None:
    """vLLM's bad_words: each word's token sequences (alone and after a space) never complete
    in the output; greedy equals transformers under the same rule (a two-token word the free
    output holds, and a one-token word), seeded n > 1 keeps them out too, and a request
    without bad words in the same batch is untouched. A blank word is a ValueError."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    prompt = random_prompts(400, [12], seed=9)[0]
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    free = llama_engine.generate([prompt], plain)[0].outputs[0].token_ids
    pair = next(
        free[i : i + 2]
        for i in range(len(free) - 1)
        if tokenizer.encode(tokenizer.decode(free[i : i + 2])) == free[i : i + 2]
        and tokenizer.decode(free[i : i + 2]).strip() == tokenizer.decode(free[i : i + 2])
    )
    single = next(t for t in free if tokenizer.decode([t]).strip() == tokenizer.decode([t]))
    words = [tokenizer.decode(pair), tokenizer.decode([single])]
    sequences = []
    for word in words:
        alone, spaced = tokenizer.encode(word), tokenizer.encode(" " + word)
        sequences += [alone] + (
            [spaced] if len(spaced) == len(alone) != 0 and spaced[0] != alone[0] else []
        )
    greedy = msgspec.structs.replace(plain, bad_words=words)
    seeded = msgspec.structs.replace(greedy, temperature=1.0, seed=5, n=3)
    outputs = llama_engine.generate([prompt] * 3, [greedy, seeded, plain])
    expected = greedy_without(load_hf_model(llama_path), prompt, sequences, 16)
    assert outputs[0].outputs[0].token_ids == expected != free
    assert outputs[2].outputs[0].token_ids == free
    for completion in outputs[0].outputs + outputs[1].outputs:
        assert len(completion.token_ids) == 16
        assert not any(contains(completion.token_ids, seq) for seq in sequences)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[" "])


def test_priority_scheduling_admits_waiting_requests_by_priority(llama_path: Path) -> None:
    """scheduling_policy "priority" through the engine and the ZeroMQ client: with one seat
    taken by a long request, three waiting requests start in priority order (lower first),
    not in arrival order; LLM.generate takes a priority per prompt."""
    with LLM(
        str(llama_path), max_num_seqs=1, scheduling_policy="priority", supervision=NO_STANDBY,
        skip_tokenizer_init=True,
    ) as llm:  # fmt: skip
        long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
        short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        client = llm.client
        client.submit([5, 6, 7], long)
        while not client.receive(10_000).token_ids:  # it runs: the one seat is taken
            pass
        seqs = {client.submit([9, 9], short, priority=p): p for p in (3, 1, 2)}
        started: list[int] = []
        while len(started) < 3:
            event = client.receive(30_000)
            assert event is not None, "no output"
            if event.seq in seqs and event.seq not in started and event.token_ids:
                started.append(event.seq)
        assert [seqs[s] for s in started] == [1, 2, 3]
        outputs = llm.generate([[4, 5], [6, 7]], short, priority=[1, 0])
        assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 2]


def test_max_logprobs_bounds_what_a_request_may_ask(llama_engine: LLM) -> None:
    """vLLM's --max-logprobs (25 in this engine): 25 top logprobs a token and a prompt token
    are given, in order; 26 is refused, before anything is scheduled."""
    from pagedserve.api.client_core import EngineRequestError

    params = SamplingParams(temperature=0, max_tokens=3, logprobs=25, prompt_logprobs=25)
    output = llama_engine.generate([[5, 6, 7]], params)[0]
    for position in output.outputs[0].logprobs + output.prompt_logprobs[1:]:
        ranked = sorted(position.values(), key=lambda lp: lp.rank)
        assert len(position) >= 25 and [lp.rank for lp in ranked[:25]] == list(range(1, 26))
        assert all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:25]))
    for asked in ({"logprobs": 26}, {"prompt_logprobs": 26}):
        with pytest.raises(EngineRequestError, match="max-logprobs"):
            llama_engine.generate([[5, 6]], SamplingParams(max_tokens=2, **asked))


def test_text_prompts_and_token_prompts_agree(llama_engine: LLM) -> None:
    text_out = llama_engine.generate("To be, or not", SamplingParams(temperature=0, max_tokens=8))
    ids = text_out[0].prompt_token_ids
    ids_out = llama_engine.generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8)
    )
    assert text_out[0].prompt == "To be, or not"
    assert text_out[0].outputs[0].token_ids == ids_out[0].outputs[0].token_ids


def test_bad_requests_raise_and_engine_keeps_serving(llama_engine: LLM) -> None:
    from pagedserve.api.client_core import EngineRequestError

    with pytest.raises(EngineRequestError, match="maximum context length"):
        llama_engine.generate([[5] * 600], GREEDY)
    with pytest.raises(EngineRequestError):
        llama_engine.generate([[10_000]], GREEDY)
    assert len(llama_engine.generate([[5, 6]], GREEDY)[0].outputs[0].token_ids) == NEW_TOKENS


def test_malformed_frames_do_not_kill_the_engine(llama_engine: LLM) -> None:
    """Garbage from a peer that holds the run's keys (test_security: one that does not cannot
    connect) reaches the scheduler's and the detokenizer's inboxes, which reject it and keep
    serving. (A worker's inbox takes frames from the scheduler's bound socket alone.)"""
    import zmq

    supervisor = llama_engine.supervisor
    inboxes = {"scheduler": supervisor.addresses.scheduler_inbox,
               "detokenizer": supervisor.addresses.detokenizer_inbox}  # fmt: skip
    ctx = bus.sync_context(supervisor.credentials.for_clients())
    try:
        for address in inboxes.values():
            sock = bus.push_socket(ctx, address)
            sock.setsockopt(zmq.SNDTIMEO, 10_000)  # a peer that never connects fails the test
            sock.send(b"\x92garbage")
            sock.close(linger=10_000)
    finally:
        ctx.destroy(linger=0)
    assert len(llama_engine.generate([[5, 6]], GREEDY)[0].outputs[0].token_ids) == NEW_TOKENS

    def rejected() -> dict[str, int]:
        actors = supervisor.status().actors
        return {a.label: a.stats.rejected for a in actors if a.stats and a.label in inboxes}

    deadline = time.monotonic() + 15  # heartbeats carry the counts, one a second
    while rejected() != dict.fromkeys(inboxes, 1) and time.monotonic() < deadline:
        llama_engine.generate([[5, 6]], GREEDY)
        time.sleep(0.2)
    assert rejected() == dict.fromkeys(inboxes, 1)
    assert supervisor.dead_reason is None


def test_shutdown_leaves_no_processes_or_sockets(llama_path: Path) -> None:
    llm = LLM(str(llama_path), num_kv_blocks=32)
    run_dir = llm.supervisor.run_dir
    pids = [p.pid for p in llm.supervisor.processes.values()]
    assert len(pids) == 4 and os.listdir(run_dir)
    llm.shutdown()
    assert not os.path.exists(run_dir)
    assert not any(
        psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids
    )


def test_tensor_parallel_two_workers_match_one(llama_path: Path) -> None:
    prompts = random_prompts(400, PROMPT_LENGTHS[:4], seed=6)
    # the KV block count then shows the sharding
    budget = dict(cpu_kv_cache_gib=0.01, skip_tokenizer_init=True)
    with LLM(str(llama_path), supervision=NO_STANDBY, **budget) as single:
        expected = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY)]
        single_blocks = single.supervisor.num_kv_blocks
    with LLM(str(llama_path), tensor_parallel_size=2, supervision=NO_STANDBY, **budget) as sharded:
        assert sorted(sharded.supervisor.processes) == [
            "detokenizer",
            "scheduler",
            "tokenizer",
            "worker",
            "worker-1",
        ]
        # each rank holds 1 of the 2 kv heads, so the same memory holds twice the blocks
        assert sharded.supervisor.num_kv_blocks // 2 == single_blocks  # (floor rounding)
        outputs = sharded.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_a_custom_chat_template_renders_chat_prompts(llama_engine: LLM) -> None:
    """`chat_template` (vLLM's --chat-template) replaces the tokenizer's template in the
    tokenizer actor: the chat prompt's tokens are the custom rendering's."""
    from tests.tiny_models import build_tokenizer

    out = llama_engine.chat([{"role": "user", "content": "To be"}], GREEDY)[0]
    assert out.prompt_token_ids == build_tokenizer().encode("<<To be>>")


def test_hf_overrides_stretch_the_context_with_yarn(tmp_path: Path) -> None:
    """vLLM's hf_overrides: a YaRN rope_scaling given at start-up (Qwen's recipe for long
    contexts) sets the context limit to original_max_position_embeddings x factor, and the
    engine's greedy tokens and logprobs are transformers' on the overridden config."""
    path = save_tiny_model("qwen3", tmp_path / "model")
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 40}
    reference = tmp_path / "reference"
    shutil.copytree(path, reference)
    config = json.loads((reference / "config.json").read_text())
    (reference / "config.json").write_text(json.dumps({**config, "rope_scaling": yarn}))
    prompts = random_prompts(400, [3, 50, 90], seed=4)
    with LLM(
        str(path), hf_overrides={"rope_scaling": yarn}, supervision=NO_STANDBY,
        skip_tokenizer_init=True,
    ) as llm:  # fmt: skip
        assert llm.supervisor.sized_config.max_model_len == 160
        outputs = llm.generate(prompts, GREEDY)
    assert_matches_transformers(reference, prompts, outputs)
    # the model without the override (whose greedy tokens the engine's equal: parity test)
    unscaled, _ = hf_greedy(load_hf_model(path), prompts[1], NEW_TOKENS)
    assert unscaled != outputs[1].outputs[0].token_ids  # the override changed the model
