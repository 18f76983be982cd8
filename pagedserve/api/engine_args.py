"""The engine's command-line flags (vLLM's names), shared by every subcommand that starts one."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pagedserve.config import DEFAULT_MODEL

ENGINE_FLAGS: dict[str, tuple[type, str]] = {
    "tokenizer": (str, "tokenizer directory or cached hub id (default: the model's)"),
    "dtype": (str, "weights and activations dtype: auto, float32, bfloat16, float16"),
    "load_format": (str, "auto (safetensors) or dummy (random weights of the real config)"),
    "max_model_len": (int, "longest prompt + output in tokens (default: the model's limit)"),
    "max_num_seqs": (int, "most requests running at once"),
    "max_num_batched_tokens": (int, "token budget of one engine step"),
    "max_waiting_requests": (
        int,
        "requests allowed to wait for a place among the running; beyond it a 503 with "
        "Retry-After (default: scaled to max_num_seqs and the KV cache)",
    ),
    "scheduling_policy": (
        str,
        "fcfs (arrival order) or priority (each request's priority, lower first, then arrival)",
    ),
    "max_logprobs": (int, "most logprobs (top tokens a position) a request may ask for"),
    "block_size": (int, "tokens per KV-cache block"),
    "num_kv_blocks": (int, "number of KV-cache blocks (default: from memory)"),
    "gpu_memory_utilization": (float, "fraction of GPU memory for weights, activations and KV"),
    "tensor_parallel_size": (int, "number of GPUs to shard the model over"),
    "pipeline_parallel_size": (int, "pipeline stages: the model's layers split over that many"),
    "pipeline_layer_partition": (
        lambda text: [int(n) for n in text.split(",")],  # an int list: "15,17"
        "decoder layers of each pipeline stage, e.g. 15,17 (default: as even as possible)",
    ),
    "distributed_executor_backend": (
        str,
        "where the workers run: mp (processes on this machine) or ray (the nodes of an "
        "existing Ray cluster; pip install 'pagedserve[ray]')",
    ),
    "device": (str, "auto, cpu or cuda"),
    "attention_backend": (str, "auto, torch, triton or cuda"),
    "seed": (int, "engine seed (dummy weights, unseeded sampling)"),
    "speculative_config": (
        json.loads,
        'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
        'or \'{"model": PATH, "num_speculative_tokens": 4}\'',
    ),
    "pooler_config": (
        json.loads,
        'how embeddings pool a prompt, as JSON, e.g. \'{"pooling_type": "MEAN", "normalize": '
        "false}' (LAST, MEAN or CLS; default: the model's sentence-transformers layout, else "
        "LAST, normalized)",
    ),
    "chat_template": (str, "a Jinja chat template, or the path of a file holding one"),
    "hf_overrides": (
        json.loads,
        'config.json fields to replace, as JSON, e.g. \'{"rope_scaling": {"rope_type": '
        '"yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}\'',
    ),
    "generation_config": (
        str,
        "sampling defaults for fields a request leaves unset: auto (the model's "
        "generation_config.json), vllm (none) or a directory holding one",
    ),
    "override_generation_config": (
        json.loads,
        "generation_config.json keys over the generation config's, as JSON, e.g. "
        "'{\"temperature\": 0.5}' (also with --generation-config vllm)",
    ),
    "tokenizer_mode": (str, "auto (the fast tokenizer where there is one) or slow"),
    "quantization": (str, "fp8, gptq, awq, compressed-tensors or int8 (default: the checkpoint's)"),
    "kv_cache_dtype": (str, "auto (the model's dtype) or fp8 (E4M3, per-tensor scales)"),
    "max_loras": (int, "with --enable-lora: most LoRA adapters in one step"),
    "max_lora_rank": (int, "with --enable-lora: the largest adapter rank"),
}
SHORT_FLAGS = {"tensor_parallel_size": ["-tp"], "pipeline_parallel_size": ["-pp"]}
ENGINE_SWITCHES = {  # vLLM's on/off flags; unset leaves the engine's default
    "skip_tokenizer_init": "no tokenizer: token ids in and out",
    "enforce_eager": "no CUDA graphs",
    "enable_lora": "serve LoRA adapters (a request names one: LoRARequest, --lora-modules)",
    "trust_remote_code": "accepted for vLLM compatibility; pagedserve runs only its own code",
    "disable_sliding_window": "sliding-window layers attend over the whole context, which is "
    "capped to the window",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="HF model directory or cached hub id"
    )
    group = parser.add_argument_group("engine")
    for name, (kind, help_text) in ENGINE_FLAGS.items():
        flags = ["--" + name.replace("_", "-"), *SHORT_FLAGS.get(name, [])]
        group.add_argument(*flags, dest=name, type=kind, default=None, help=help_text)
    for name, help_text in ENGINE_SWITCHES.items():
        group.add_argument(
            "--" + name.replace("_", "-"), action="store_true", default=None, help=help_text
        )
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="automatic prefix caching (on by default)",
    )
    add_vllm_compat_args(parser)


def add_vllm_compat_args(parser: argparse.ArgumentParser) -> None:
    """vLLM flags for what this engine always does: accepted, and a value it cannot honour is
    an error at start (check_vllm_compat_args)."""
    group = parser.add_argument_group("vLLM flags for what pagedserve always does")
    group.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
        help="prompts are always chunked into --max-num-batched-tokens steps (as vLLM V1): "
        "accepted; --no-enable-chunked-prefill is an error",
    )  # fmt: skip
    group.add_argument(
        "--async-scheduling", action="store_true",
        help="accepted: the scheduler always plans the next steps while the device runs",
    )  # fmt: skip
    group.add_argument(
        "--disable-log-stats", action="store_true",
        help="accepted: the engine logs no periodic stats (they are served at /metrics)",
    )  # fmt: skip
    group.add_argument(
        "--swap-space", type=float, default=None, metavar="GiB",
        help="accepted: preemption recomputes (as vLLM V1), so no CPU swap space is used",
    )  # fmt: skip
    group.add_argument(
        "--runner", default=None,
        help="auto, generate or pooling: accepted; the model says what it serves (a causal LM: "
        "generation and embeddings; a *ForSequenceClassification model: classification)",
    )  # fmt: skip
    group.add_argument(
        "--task", default=None,
        help="vLLM's legacy --runner: auto, generate, embed, embedding, score or classify "
        "(accepted; the model says what it serves)",
    )  # fmt: skip
    group.add_argument(
        "--data-parallel-size", "-dp", type=int, default=None,
        help="engine replicas: only 1 (data parallelism is not supported)",
    )  # fmt: skip


RUNNERS = ("auto", "generate", "pooling")
TASKS = ("auto", "generate", "embed", "embedding", "score", "classify")


def check_vllm_compat_args(args: argparse.Namespace) -> None:
    """ValueError for a vLLM flag's value that this engine cannot honour."""
    if args.enable_chunked_prefill is False:
        raise ValueError(
            "chunked prefill is always on (prompts run in --max-num-batched-tokens chunks); "
            "--no-enable-chunked-prefill is not supported"
        )
    if args.runner is not None and args.runner not in RUNNERS:
        raise ValueError(
            f"--runner {args.runner!r} is not supported: pagedserve serves generation, "
            "embeddings and classification (auto, generate or pooling)"
        )
    if args.task is not None and args.task not in TASKS:
        raise ValueError(
            f"--task {args.task!r} is not supported: pagedserve serves generation, "
            f"embeddings and classification ({', '.join(TASKS)})"
        )
    if args.data_parallel_size is not None and args.data_parallel_size != 1:
        raise ValueError(
            f"--data-parallel-size {args.data_parallel_size}: data parallelism is not "
            "supported (run one server a replica)"
        )
    if args.swap_space is not None and args.swap_space < 0:
        raise ValueError("--swap-space must be at least 0")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields the flags set; ValueError for a value that cannot work."""
    check_vllm_compat_args(args)
    names = [*ENGINE_FLAGS, *ENGINE_SWITCHES, "enable_prefix_caching"]
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
