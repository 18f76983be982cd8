"""Tiny random Hugging Face models (with a tokenizer) saved to disk, for tests that load them
the way a user would: from a model directory."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "To be, or not to be, that is the question:",
    "Whether 'tis nobler in the mind to suffer",
    "The slings and arrows of outrageous fortune,",
    "Or to take arms against a sea of troubles",
    "And by opposing end them. To die: to sleep;",
    "Friends, Romans, countrymen, lend me your ears; héllo wörld 日本語 🙂",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

CONFIGS = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    # Phi-3 with Phi-4-mini's partial rotary (its own pad id: Phi3Config's is past this vocab)
    "phi3": functools.partial(transformers.Phi3Config, partial_rotary_factor=0.75, pad_token_id=0),
    # Gemma 2 / 3 with windows of 8 tokens (Gemma 2: every other layer; Gemma 3: all but every
    # second), softcaps and a query scale small enough to change the logits at this size
    "gemma2": functools.partial(
        transformers.Gemma2Config,
        sliding_window=8,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0,
    ),
    "gemma3": functools.partial(
        transformers.Gemma3TextConfig,
        sliding_window=8,
        sliding_window_pattern=2,
        query_pre_attn_scalar=16,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),  # fmt: skip
    # GPT-OSS: 4 experts (top 2), windows of 8 on every other layer, YaRN from 64 positions to
    # the 512 the tiny models have; the default clamp (transformers 5.17, the GPU image's,
    # ignores the config's swiglu_limit: 7.0 always)
    "gpt_oss": functools.partial(
        transformers.GptOssConfig,
        sliding_window=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    ),  # fmt: skip
}
# configs whose head_dim is not hidden / heads
HEAD_DIM_GIVEN = ("qwen3", "gemma2", "gemma3", "gpt_oss")


def build_tokenizer(vocab_size: int = 400) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_model(
    arch: str,
    path: Path,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    tie_word_embeddings: bool = False,
    num_labels: int | None = None,
) -> Path:
    """A random model of `arch` (2 layers unless told) with peaked logits (so greedy has no
    near-ties); 4 query heads of hidden_size / 4 dims, 2 kv heads. With `num_labels`:
    transformers' *ForSequenceClassification of that many labels instead of the causal LM."""
    tokenizer = build_tokenizer()
    extra = {"head_dim": hidden_size // 4} if arch in HEAD_DIM_GIVEN else {}
    config = CONFIGS[arch](
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.15,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **extra,
    )
    auto = transformers.AutoModelForCausalLM
    if num_labels is not None:
        config.num_labels = num_labels
        auto = transformers.AutoModelForSequenceClassification
    torch.manual_seed(seed)
    model = auto.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    record_tokenizer_class(path)
    return path


def record_tokenizer_class(path: Path) -> None:
    """Load the tokenizer at `path` once here (milliseconds: this process has torch), as an
    engine's actors load it, so that AutoTokenizer's choice of class is recorded for the
    directory (actors/chat.py's TokenizerClassRecord, keyed by its path and files). The
    tokenizer, detokenizer and API server of every engine started on it then build that class
    directly, as on any later start of a model, instead of each importing torch for the choice:
    about 2 s of each first start on a 2-core machine. Call it again after changing a deciding
    file (config.json...); a directory without a tokenizer is left alone. The first load's
    own path is test_tokenizer_load.py's."""
    from pagedserve.actors.chat import load_tokenizer

    if (Path(path) / "tokenizer_config.json").is_file():
        load_tokenizer(str(path))


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in range(n)] for n in lengths]


def load_hf_model(path: Path | str) -> transformers.PreTrainedModel:
    """transformers' float32 model from `path`, with EOS off (greedy runs to max tokens); with
    eager attention where the model caps its attention logits or has attention sinks (Gemma 2,
    GPT-OSS: transformers' SDPA attention, the default of some versions, leaves them out)."""
    config = transformers.AutoConfig.from_pretrained(path)
    needs_eager = getattr(config, "attn_logit_softcapping", None) or config.model_type == "gpt_oss"
    eager = {"attn_implementation": "eager"} if needs_eager else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **eager)
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(
    model: transformers.PreTrainedModel, prompt: list[int], max_new_tokens: int
) -> tuple[list[int], list[float]]:
    """transformers' own greedy tokens and the raw-logit logprob of each chosen token."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(step_logits[0].float(), -1)[t].item()
        for step_logits, t in zip(out.logits, tokens)
    ]
    return tokens, logprobs


def pick_stop_string(text: str, length: int = 3) -> str:
    """A substring of `text` (past its start) whose first occurrence is where we take it, with
    no replacement characters: text before it is exactly what a stop at it must leave."""
    for start in range(3, len(text) - length):
        candidate = text[start : start + length]
        if "\ufffd" not in candidate and candidate.strip() and text.index(candidate) == start:
            return candidate
    raise AssertionError(f"no usable stop string in {text!r}")


def hf_beam_search(
    model: transformers.PreTrainedModel,
    prompt: list[int],
    beam_width: int,
    max_tokens: int,
    eos_token_ids: set[int],
    length_penalty: float = 1.0,
) -> list[tuple[list[int], float]]:
    """vLLM's beam search written plainly over transformers' next-token log-softmax (each
    beam's 2 x beam_width best tokens; an EOS completes a beam; score = cumulative logprob /
    length ** length_penalty, the length without a final EOS): the best (tokens with the
    prompt's, cumulative logprob), best first."""

    def score(beam: tuple[list[int], float]) -> float:
        tokens, cum = beam
        return cum / (len(tokens) - (tokens[-1] in eos_token_ids)) ** length_penalty

    live: list[tuple[list[int], float]] = [(list(prompt), 0.0)]
    done: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        children = []
        for tokens, cum in live:
            with torch.inference_mode():
                logits = model(torch.tensor([tokens])).logits[0, -1].float()
            top = torch.topk(torch.log_softmax(logits, -1), 2 * beam_width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist()):
                child = (tokens + [token], cum + logprob)
                (done if token in eos_token_ids else children).append(child)
        children.sort(key=score, reverse=True)
        live = children[:beam_width]
        if not live:
            break
    return sorted(done + live, key=score, reverse=True)[:beam_width]


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_lora_adapter(
    base: Path,
    path: Path,
    seed: int,
    rank: int = 4,
    alpha: int = 8,
    targets: list[str] = LORA_TARGETS,
) -> Path:
    """A random LoRA adapter for the model at `base`, in PEFT's layout (adapter_config.json,
    adapter_model.safetensors: A [r, in], B [out, r] of every target in every layer), large
    enough to change greedy tokens."""
    from safetensors.torch import save_file

    model = load_hf_model(base)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for index, layer in enumerate(model.model.layers):
        for target in targets:
            block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            linear = getattr(getattr(layer, block), target)
            prefix = f"base_model.model.model.layers.{index}.{block}.{target}"
            shape_a, shape_b = (rank, linear.in_features), (linear.out_features, rank)
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(shape_a, generator=generator) * 0.3
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(shape_b, generator=generator) * 0.3
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets,
              "bias": "none", "base_model_name_or_path": str(base)}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def merge_lora(base: Path, adapter: Path) -> transformers.PreTrainedModel:
    """transformers' model of `base` with the adapter merged into its weights (W + s B A): the
    oracle of a request that runs with the adapter."""
    from safetensors.torch import load_file

    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    model = load_hf_model(base)
    with torch.no_grad():
        for name, module in model.named_modules():
            key = f"base_model.model.{name}.lora_A.weight"
            if key in tensors:
                b = tensors[key.replace("lora_A", "lora_B")]
                module.weight += scale * b @ tensors[key]
    return model


def hf_embedding(
    model: transformers.PreTrainedModel,
    prompt: list[int],
    pooling_type: str,
    normalize: bool = True,
    dimensions: int | None = None,
) -> list[float]:
    """transformers' last hidden state (the base model's output, after its final norm) pooled
    and cut as the engine should."""
    with torch.inference_mode():
        hidden = model.model(torch.tensor([prompt])).last_hidden_state[0]
    pooled = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling_type]
    pooled = pooled[:dimensions]
    return (torch.nn.functional.normalize(pooled, dim=0) if normalize else pooled).tolist()
