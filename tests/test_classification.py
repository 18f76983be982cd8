"""Sequence-classification models (`*ForSequenceClassification`), as a vLLM user meets them:
`LLM.classify` and the server's /classify give each prompt its labels' probabilities (vLLM's:
a softmax of the score head's logits over the prompt's last token; a sigmoid for one label),
which equal transformers' own. Such a model serves nothing else: generation and embeddings
are refused (a ValueError offline, a 400 online), as is classification by a causal LM, and so
are scores of a classifier of more than one label (a cross-encoder's scores:
tests/test_cross_encoder.py).

The engines share one model directory each (module fixtures) and take token ids
(skip_tokenizer_init: no tokenizer to load; a text is encoded as an embedding's is)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx2 as httpx
import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.actors.worker import startup
from pagedserve.actors.worker.model_runner import ModelRunner
from pagedserve.api.cli import build_parser
from pagedserve.api.engine_args import engine_kwargs
from pagedserve.config import EngineConfig, ServerConfig, read_hf_config
from pagedserve.models.model_config import check_task, supported_tasks
from tests.engine_settings import NO_STANDBY
from tests.test_openai_server import free_port, running_server
from tests.tiny_models import random_prompts, save_tiny_model

ATOL = 1e-5  # float32 on both sides
LABELS = ["negative", "neutral", "positive"]  # the Llama classifier's id2label
# inside a block, on block edges, and prompts longer than the token budget (several chunks)
PROMPT_LENGTHS = [1, 5, 16, 17, 40, 90]
CHUNKED = {"max_num_batched_tokens": 32, "max_num_seqs": 8}
MAX_MODEL_LEN = 128
ENGINE = {**CHUNKED, "max_model_len": MAX_MODEL_LEN, "num_kv_blocks": 64, "supervision": NO_STANDBY}
TOKEN_IDS = {"skip_tokenizer_init": True}


def save_classifier(arch: str, path: Path, labels: list[str]) -> Path:
    """transformers' random *ForSequenceClassification of `arch` with these labels."""
    save_tiny_model(arch, path, num_labels=len(labels))
    config = json.loads((path / "config.json").read_text())
    config["id2label"] = {str(index): label for index, label in enumerate(labels)}
    config["label2id"] = {label: index for index, label in enumerate(labels)}
    (path / "config.json").write_text(json.dumps(config))
    return path


def hf_probs(model: transformers.PreTrainedModel, prompt: list[int]) -> list[float]:
    """transformers' logits of `prompt` (its last token's, through the score head) with vLLM's
    activation: a softmax over the labels, a sigmoid for one label."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return (logits.sigmoid() if len(logits) == 1 else logits.softmax(-1)).tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("classifiers")
    return {
        "llama": save_classifier("llama", root / "llama", LABELS),
        "qwen3": save_classifier("qwen3", root / "qwen3", ["score"]),
        "causal": save_tiny_model("llama", root / "causal"),
    }


@pytest.fixture(scope="module")
def llama_classifier(models):
    with LLM(str(models["llama"]), **ENGINE, **TOKEN_IDS) as llm:
        yield llm


# ---------------------------------------------------------------- offline


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_classify_equals_transformers_for_a_batch_of_prompts_of_every_length(
    models, llama_classifier: LLM, arch: str
) -> None:
    """A batch of prompts of different lengths, some prefilled in several chunks: each one's
    probabilities are transformers' (three labels: a softmax; Qwen3's one label: a sigmoid),
    in prompt order, with the prompt's ids; a prompt alone gives what it gives in the batch.
    Qwen3 runs on two pipeline stages: the last one holds the score head, pools and
    classifies."""
    prompts = random_prompts(400, PROMPT_LENGTHS, seed=1)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        models[arch], dtype=torch.float32
    )
    if arch == "llama":
        outputs, alone = llama_classifier.classify(prompts), llama_classifier.classify(prompts[3])
    else:
        with LLM(str(models[arch]), **ENGINE, pipeline_parallel_size=2, **TOKEN_IDS) as llm:
            outputs, alone = llm.classify(prompts), llm.classify(prompts[3])
    assert len(outputs) == len(prompts)
    for prompt, output in zip(prompts, outputs):
        assert output.finished and output.prompt_token_ids == prompt
        assert output.outputs.probs == pytest.approx(hf_probs(model, prompt), abs=ATOL)
        assert output.outputs.num_classes == model.config.num_labels
    assert alone[0].outputs.probs == pytest.approx(outputs[3].outputs.probs, abs=ATOL)


def test_a_classifier_serves_nothing_but_classification(llama_classifier: LLM) -> None:
    """Generation and embeddings are ValueErrors that name what the model serves, and scores
    (a cross-encoder's) of three labels one that asks for one; the engine goes on
    classifying."""
    with pytest.raises(ValueError, match="serves classification, not generation"):
        llama_classifier.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="serves classification, not embeddings"):
        llama_classifier.embed([[1, 2, 3]])
    with pytest.raises(ValueError, match="a cross-encoder. need one label.*this model has 3"):
        llama_classifier.score([1, 2], [[3, 4]])
    assert llama_classifier.classify([[1, 2, 3]])[0].outputs.num_classes == len(LABELS)
    assert not llama_classifier.supervisor.restarts


def test_a_causal_lm_generates_and_embeds_but_does_not_classify(models) -> None:
    """What the engine's tokenizer checks each request against (the classifier's refusals
    above take the same check): a model without a classification head refuses to classify."""
    causal = read_hf_config(str(models["causal"]))
    assert supported_tasks(causal) == ("generate", "embed")
    with pytest.raises(ValueError, match="LlamaForCausalLM serves generation and embeddings, not"):
        check_task(causal, "classify")
    assert supported_tasks(read_hf_config(str(models["llama"]))) == ("classify",)


def test_a_classifiers_start_up_steps_pool_and_build_no_decode_path(models) -> None:
    """A classifier samples nothing: the start-up's synthetic steps (a GPU's warm-up and dry
    run, run here on the CPU) are pooling requests and leave the runner empty, and it gets no
    static decode path (its requests all pool, which takes the general path)."""
    config = EngineConfig(model=str(models["llama"]), **ENGINE, **TOKEN_IDS)
    runner = ModelRunner(config.resolve())
    runner.load_model()
    startup.init_kv_cache(runner, 64)
    plans = startup._warm_up_plans(runner, 64 * runner.block_size)
    assert plans and all(r.pooling is not None for plan, _ in plans for r in plan.new_requests)
    startup.warm_up_eager_kernels(runner, 64)
    startup.dry_run(runner)
    assert runner.decode_step is None and len(runner.input_batch) == 0


def test_vllms_classify_flags_are_accepted() -> None:
    args = build_parser().parse_args(["serve", "--task", "classify", "--runner", "pooling"])
    assert engine_kwargs(args) == {}


# ---------------------------------------------------------------- the HTTP server


@pytest.fixture(scope="module")
def server(models):
    config = EngineConfig(
        model=str(models["llama"]), **ENGINE, **TOKEN_IDS,
        server=ServerConfig(port=free_port(), served_model_name="tiny", max_prompts_per_request=8),
    )  # fmt: skip
    with running_server(config) as base:
        yield base


def test_classify_answers_in_vllms_shape(server, models) -> None:
    """Each input's probabilities (transformers'), the likeliest label's name and the number
    of labels, in input order; the inputs' tokens as usage. /v1/classify is the same, and one
    input may come alone."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        models["llama"], dtype=torch.float32
    )
    prompts = random_prompts(400, [3, 40], seed=5)
    answer = httpx.post(server + "/classify", json={"model": "tiny", "input": prompts}).json()
    assert answer["id"].startswith("classify-") and answer["object"] == "list"
    assert isinstance(answer["created"], int) and answer["model"] == "tiny"
    assert answer["usage"] == {"prompt_tokens": 43, "total_tokens": 43}
    for index, (item, prompt) in enumerate(zip(answer["data"], prompts)):
        probs = hf_probs(model, prompt)
        assert item["index"] == index and item["num_classes"] == len(LABELS)
        assert item["probs"] == pytest.approx(probs, abs=ATOL)
        assert item["label"] == LABELS[max(range(len(probs)), key=probs.__getitem__)]
    one = httpx.post(server + "/v1/classify", json={"input": prompts[0]}).json()
    assert one["data"][0]["probs"] == pytest.approx(answer["data"][0]["probs"], abs=ATOL)


@pytest.mark.parametrize(
    "body, message",
    [
        ({"input": []}, "input must not be empty"),
        ({"input": [[]]}, "must not be empty"),
        ({"input": [[5] * (MAX_MODEL_LEN + 1)]}, "maximum context length"),
        ({"input": "x" * 100_000}, "maximum context length"),
        ({"input": 5}, "Expected `str | array`"),
        ({"input": [[1], "a"]}, "input must be a string"),
        ({"input": [400_000]}, "token ids must be in"),
        ({"input": [[1]] * 9}, "at most 8 prompts"),
        ({"input": [1], "priority": "high"}, "Expected `int"),
        ({}, "missing required field `input`"),
    ],
)
def test_bad_classify_requests_are_400s(server, body: dict, message: str) -> None:
    reply = httpx.post(server + "/classify", json={"model": "tiny", **body})
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]["message"]


def test_what_a_classifier_does_not_serve_is_a_400_and_an_unknown_model_a_404(server) -> None:
    completion = httpx.post(server + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert completion.status_code == 400
    assert "serves classification, not generation" in completion.json()["error"]["message"]
    embedding = httpx.post(server + "/v1/embeddings", json={"input": [1, 2]})
    assert embedding.status_code == 400
    assert "serves classification, not embeddings" in embedding.json()["error"]["message"]
    score = httpx.post(server + "/score", json={"text_1": "a", "text_2": ["b"]})
    assert score.status_code == 400 and "need one label" in score.json()["error"]["message"]
    rerank = httpx.post(server + "/rerank", json={"query": "a", "documents": ["b"]})
    assert rerank.status_code == 400 and "need one label" in rerank.json()["error"]["message"]
    unknown = httpx.post(server + "/classify", json={"model": "nope", "input": [1]})
    assert unknown.status_code == 404
