"""Constrained decoding (response_format, vLLM's guided_json / structured_outputs) and prompt
logprobs (vLLM's prompt_logprobs, completions echo with logprobs) through the HTTP server and
the official `openai` client, on the embedded model; transformers is the logprobs' oracle."""

from __future__ import annotations

import json
import random
import re

import anyio
import httpx2 as httpx
import jsonschema
import openai
import pytest
import torch

from pagedserve.actors.supervisor import Supervisor
from pagedserve.config import ASSETS_DIR, EngineConfig, ServerConfig
from tests.engine_settings import NO_STANDBY
from tests.json_schemas import random_schema
from tests.test_openai_server import free_port
from tests.tiny_models import load_hf_model

MODEL_NAME = "tiny-shakespeare"
MODEL_PATH = ASSETS_DIR / "tiny-shakespeare"
NUM_SCHEMAS = 20
LOGPROB_ATOL = 1e-3  # float32 on both sides


@pytest.fixture(scope="module")
def server():
    port = free_port()
    config = EngineConfig(
        model=str(MODEL_PATH),
        max_model_len=512,
        num_kv_blocks=512,
        max_num_seqs=32,
        server=ServerConfig(port=port, served_model_name=MODEL_NAME),
        supervision=NO_STANDBY,
    )
    supervisor = Supervisor(config)
    supervisor.start(extra_actors=("api-server",))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        supervisor.stop()


@pytest.fixture
def api(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


async def test_twenty_random_schemas_each_produce_valid_json(server: str) -> None:
    """Concurrent requests on both endpoints, each with its own schema, sampled at
    temperature 1 (the model alone would never write JSON): every output validates."""
    rng = random.Random(10)
    schemas = [random_schema(rng) for _ in range(NUM_SCHEMAS)]
    texts: dict[int, tuple[str, str | None]] = {}
    client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", max_retries=0)

    async def one(i: int) -> None:
        schema = schemas[i]
        if i % 2:
            chat = await client.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": "Describe ROMEO as JSON."}],
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": f"schema{i}", "schema": schema},
                },
                max_tokens=400,
                seed=i,
            )
            choice = chat.choices[0]
            texts[i] = (choice.message.content or "", choice.finish_reason)
        else:
            completion = await client.completions.create(
                model=MODEL_NAME,
                prompt="JULIET:",
                max_tokens=400,
                seed=i,
                extra_body={"guided_json": schema},
            )
            texts[i] = (completion.choices[0].text, completion.choices[0].finish_reason)

    async with client, anyio.create_task_group() as group:
        for i in range(NUM_SCHEMAS):
            group.start_soon(one, i)
    for i, schema in enumerate(schemas):
        text, finish_reason = texts[i]
        assert finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


async def test_json_object_output_parses_and_text_is_unconstrained(server: str) -> None:
    """Any JSON object. This model writes Shakespeare into its strings and closes only empty
    objects, so the test samples among its top 2 tokens with seeds: every output is an object
    or the start of one, and every one that ends parses (the 20 schemas cover nested ones)."""
    client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    outputs: list[tuple[str, str | None]] = []

    async def one(seed: int) -> None:
        completion = await client.completions.create(
            model=MODEL_NAME,
            prompt="\n",
            max_tokens=40,
            seed=seed,
            extra_body={"top_k": 2, "response_format": {"type": "json_object"}},
        )
        outputs.append((completion.choices[0].text, completion.choices[0].finish_reason))

    async with client, anyio.create_task_group() as group:
        for seed in range(8):
            group.start_soon(one, seed)
    ended = [text for text, finish_reason in outputs if finish_reason == "stop"]
    assert len(ended) >= 2, outputs
    assert all(isinstance(json.loads(text), dict) for text in ended)
    assert all(text.startswith("{") for text, _ in outputs)
    unconstrained = openai.OpenAI(base_url=server + "/v1", api_key="none").chat.completions
    text = unconstrained.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "ROMEO:"}],
        response_format={"type": "text"},
        max_tokens=8,
        temperature=0.0,
    )
    assert not (text.choices[0].message.content or "").startswith("{")  # the model's own


def test_choice_and_regex_of_vllm_structured_outputs(api: openai.OpenAI) -> None:
    choice = api.completions.create(
        model=MODEL_NAME,
        prompt="ROMEO:",
        max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["Montague", "Capulet"]}},
    )
    assert choice.choices[0].text in ("Montague", "Capulet")
    regex = api.completions.create(
        model=MODEL_NAME, prompt="ROMEO:", max_tokens=20, extra_body={"guided_regex": "[0-9]{3}"}
    )
    assert len(regex.choices[0].text) == 3 and regex.choices[0].text.isdigit()


def test_structural_tags_as_a_response_format(api: openai.OpenAI) -> None:
    """vLLM's response_format {"type": "structural_tag"}: free text until the trigger, then
    the structure's begin, schema (a JSON schema here, in the engine's JSON layout) and end."""
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["aye", "nay"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    response_format = {
        "type": "structural_tag",
        "structures": [{"begin": "KING JOHN:", "schema": schema, "end": "\n"}],
        "triggers": ["KING"],
    }
    text = (
        api.completions.create(
            model=MODEL_NAME,
            prompt="KING LEAR:\nKING LEAR:",
            max_tokens=60,
            temperature=0,
            extra_body={"response_format": response_format},
        )
        .choices[0]
        .text
    )
    match = re.search(r"KING JOHN:(.*)\n", text)
    assert match is not None and re.fullmatch(r'\{"answer": "(aye|nay)"\}', match.group(1)), text


def test_context_free_grammars_in_lark_and_gbnf(api: openai.OpenAI) -> None:
    """vLLM's guided_grammar and structured_outputs.grammar: a Lark grammar (rules and a
    terminal regex) and a GBNF one (llama.cpp's syntax); each output is a sentence of its
    grammar, which ends the request."""
    lark = 'start: greeting " " name\ngreeting: "Hail" | "Farewell"\nname: /[A-Z][a-z]{2,5}/'
    text = api.completions.create(
        model=MODEL_NAME, prompt="ROMEO:", max_tokens=30, extra_body={"guided_grammar": lark}
    ).choices[0]
    assert re.fullmatch(r"(Hail|Farewell) [A-Z][a-z]{2,5}", text.text), text.text
    assert text.finish_reason == "stop"
    gbnf = 'root ::= ("yes" | "no") ", " [a-z] [a-z] [a-z]'
    chat = api.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Well?"}],
        max_tokens=20,
        extra_body={"structured_outputs": {"grammar": gbnf}},
    )
    assert re.fullmatch(r"(yes|no), [a-z]{3}", chat.choices[0].message.content or "")


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"guided_json": "{not json"}, "not valid JSON"),
        ({"guided_json": {"type": "no-such-type"}}, "invalid structured output"),
        ({"guided_regex": "(unclosed"}, "invalid structured output"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
        ({"response_format": {"type": "yaml"}}, "not supported"),
        ({"guided_grammar": "start: ("}, "invalid structured output"),
        ({"guided_grammar": "root ::= ("}, "invalid structured output"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "invalid structured output"),
        ({"guided_grammar": "start: 'a'", "guided_regex": "a"}, "one of"),
        ({"guided_json": {}, "guided_regex": "a"}, "one of"),
        ({"structured_outputs": {"structural_tag": {}}}, "structural_tag"),
        ({"response_format": {"type": "structural_tag", "triggers": ["<"]}}, "no structures"),
    ],
)
def test_a_bad_constraint_is_a_400_before_it_is_scheduled(
    server: str, fields: dict, message: str
) -> None:
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, **fields}
    response = httpx.post(server + "/v1/completions", json=body)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def oracle_prompt_logprobs(token_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every prompt position: row p predicts token p + 1."""
    model = load_hf_model(MODEL_PATH)
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_echo_with_logprobs_scores_the_prompt_first(server: str, api: openai.OpenAI) -> None:
    prompt = "ROMEO: But soft, what light through yonder window breaks?"
    out = api.completions.create(
        model=MODEL_NAME, prompt=prompt, echo=True, logprobs=2, max_tokens=3, temperature=0.0
    )
    prompt_ids = httpx.post(
        server + "/tokenize", json={"model": MODEL_NAME, "prompt": prompt}
    ).json()["tokens"]
    expected = oracle_prompt_logprobs(prompt_ids)
    choice = out.choices[0]
    logprobs = choice.logprobs
    assert choice.text.startswith(prompt)
    assert len(logprobs.tokens) == len(prompt_ids) + 3
    assert "".join(logprobs.tokens[: len(prompt_ids)]) == prompt
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.text_offset[: len(prompt_ids) + 1][-1] == len(prompt)
    for p in range(1, len(prompt_ids)):
        row = expected[p - 1]
        assert logprobs.token_logprobs[p] == pytest.approx(row[prompt_ids[p]].item(), abs=1e-3)
        top = logprobs.top_logprobs[p]
        assert len(top) in (2, 3)  # the top 2, and the prompt's token when it is not in them
        best = row.topk(2).values.tolist()
        assert sorted(top.values(), reverse=True)[:2] == pytest.approx(best, abs=LOGPROB_ATOL)


def test_prompt_logprobs_field_as_vllm(server: str) -> None:
    body = {"model": MODEL_NAME, "prompt": "ROMEO: hello", "max_tokens": 2, "prompt_logprobs": 1}
    response = httpx.post(server + "/v1/completions", json=body).json()
    entries = response["choices"][0]["prompt_logprobs"]
    prompt_ids = httpx.post(
        server + "/tokenize", json={"model": MODEL_NAME, "prompt": "ROMEO: hello"}
    ).json()["tokens"]
    expected = oracle_prompt_logprobs(prompt_ids)
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for p, entry in enumerate(entries[1:], 1):
        own = entry[str(prompt_ids[p])]
        assert own["logprob"] == pytest.approx(expected[p - 1, prompt_ids[p]].item(), abs=1e-3)
        assert own["rank"] == int((expected[p - 1] >= expected[p - 1, prompt_ids[p]]).sum())
        assert any(item["rank"] == 1 for item in entry.values())
    chat = httpx.post(
        server + "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
              "max_tokens": 2, "prompt_logprobs": 0},
    ).json()  # fmt: skip
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1
    streamed = httpx.post(server + "/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 400


def test_streamed_echo_with_logprobs_scores_the_prompt_in_the_first_chunk(
    api: openai.OpenAI,
) -> None:
    kwargs = dict(model=MODEL_NAME, prompt="ROMEO: But soft", echo=True, logprobs=1, max_tokens=4)
    whole = api.completions.create(temperature=0.0, **kwargs).choices[0].logprobs
    chunks = list(api.completions.create(temperature=0.0, stream=True, **kwargs))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert streamed[0].token_logprobs[0] is None  # the prompt's first token, in chunk one
    assert [t for lp in streamed for t in lp.tokens] == whole.tokens
    assert [o for lp in streamed for o in lp.text_offset] == whole.text_offset
    got = [lp for chunk in streamed for lp in chunk.token_logprobs]
    assert got[1:] == pytest.approx(whole.token_logprobs[1:], abs=1e-5)
