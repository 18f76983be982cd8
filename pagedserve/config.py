"""One typed configuration object, passed explicitly to every actor.

`EngineConfig` is a msgspec Struct so that it crosses process boundaries as plain msgpack, the
codec the bus uses (inside the supervisor's `ActorLaunch`). `resolve()` fills every
"auto" field from the model directory once, in the parent process, so each actor sees the
same concrete values.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import msgspec

from pagedserve.cpus import usable_cpus
from pagedserve.layout import check_layout
from pagedserve.models.model_config import (
    active_sliding_window,
    context_limit,
    with_score_head_method,
)
from pagedserve.models.pooling_layout import model_pooling

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "pagedserve/tiny-shakespeare"
# vLLM's names (models/quantization/config.py says what each means)
QUANTIZATION_METHODS = ("fp8", "gptq", "awq", "compressed-tensors", "int8", "mxfp4")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
TOKENIZER_MODES = ("auto", "slow")  # vLLM's mistral mode is not supported
ASSETS_DIR = Path(__file__).parent / "assets"


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "openai")  # api/tool_parsers.py
REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss")  # api/reasoning_parsers.py
HARMONY_REASONING = (None, "openai_gptoss")  # the reasoning parsers the openai tool parser takes


class ServerConfig(msgspec.Struct, kw_only=True):
    """The HTTP server's settings (`pagedserve serve`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    uvicorn_log_level: str = "warning"
    # else each request is logged at INFO (--disable-log-requests / --enable-log-requests)
    disable_log_requests: bool = False
    # the request log shows each prompt cut to this many characters or token ids (0: none of
    # it: prompts are users' data, so the log holds them only when asked to)
    max_log_len: int = 0
    # TLS (uvicorn's): the server answers https with a certificate and its key
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    root_path: str = ""  # the path prefix of a proxy in front of the server (uvicorn's)
    # CORS (Starlette's CORSMiddleware): none unless allowed_origins is given, so that web
    # pages of other origins cannot read a local server's answers (vLLM allows all origins)
    allowed_origins: list[str] | None = None
    allowed_methods: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    response_role: str = "assistant"  # the role of a chat completion's message
    # vLLM's server-wide defaults of request options: logprobs name tokens "token_id:{id}";
    # usage.prompt_tokens_details.cached_tokens (prefix-cache hits); usage at the end of
    # every stream, as if stream_options.include_usage were set
    return_tokens_as_token_ids: bool = False
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    # malloc_trim(0) this often (0: never): glibc keeps the free pages between live chunks of
    # its heap resident, and the server's RSS creeps up without it (actors/heap_trim.py)
    heap_trim_interval_s: float = 10.0
    health_check_timeout_s: float = 2.0  # /health: deadline of the round trip to the engine
    # Request limits, checked before anything is decoded, tokenized or queued (a 4xx beyond)
    max_request_body_bytes: int = 8 * 1024 * 1024
    max_json_depth: int = 32  # nesting of arrays and objects in a request body
    max_prompt_chars: int = 4 * 1024 * 1024  # characters of one prompt (or chat) before tokenizing
    max_prompts_per_request: int = 1024  # a completions call with a list of prompts
    max_n: int = 128  # choices per prompt (n, best_of)
    max_stop_strings: int = 64
    max_stop_string_chars: int = 1024  # also the longest bad word
    max_stop_token_ids: int = 1024
    max_bad_words: int = 64
    # "auto" tool choice: calls found in the reply's text by this parser (api/tool_parsers.py)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # a chat reply's thinking (<think>...</think>, GPT-OSS's analysis channel) as its
    # reasoning_content (api/reasoning_parsers.py)
    reasoning_parser: str | None = None
    # LoRA adapters served by name (the request's `model`): name -> adapter directory
    lora_modules: dict[str, str] = msgspec.field(default_factory=dict)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's, behind its
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING): off by default, as they let any client that reaches
    # the server open paths of its file system and unload the adapters others use
    allow_runtime_lora_updating: bool = False
    max_lora_adapters: int = 256  # adapters served by name at once (--lora-modules included)

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser {self.tool_call_parser!r} is not one of {TOOL_CALL_PARSERS}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser {self.reasoning_parser!r} is not one of {REASONING_PARSERS}"
            )
        if self.tool_call_parser == "openai" and self.reasoning_parser not in HARMONY_REASONING:
            raise ValueError(
                "tool_call_parser 'openai' reads GPT-OSS's harmony messages: the reasoning_parser "
                "with it is openai_gptoss or none"
            )
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("TLS needs both ssl_keyfile and ssl_certfile")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError("ssl_ca_certs needs ssl_certfile and ssl_keyfile (TLS)")
        cors_options = (self.allowed_methods, self.allowed_headers, self.allow_credentials)
        if self.allowed_origins is None and cors_options != (["*"], ["*"], False):
            raise ValueError(
                "allowed_methods, allowed_headers and allow_credentials need allowed_origins "
                "(CORS is off without it)"
            )
        if self.max_log_len < 0:
            raise ValueError("max_log_len must be at least 0")
        if len(self.lora_modules) > self.max_lora_adapters:
            raise ValueError(
                f"{len(self.lora_modules)} LoRA modules exceed max_lora_adapters "
                f"{self.max_lora_adapters}"
            )


class ProfileConfig(msgspec.Struct, kw_only=True):
    """Profiling of rank 0's worker (see actors/worker/profiling.py): a torch.profiler window
    over `num_steps` steps (0: none), the actors' loop timers, and a log of every step (its
    shape, host and device time, Triton compiles)."""

    output_dir: str
    first_step: int = 200  # launches skipped first (warm-up, the prefill burst)
    num_steps: int = 20


SPECULATIVE_METHODS = ("ngram", "draft_model")


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Speculative decoding, vLLM's `speculative_config`: {"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}, or
    {"model": PATH, "num_speculative_tokens": 4} (a draft model with the target's vocabulary,
    run by the same workers on its own paged KV cache)."""

    num_speculative_tokens: int
    method: str | None = None  # ngram | draft_model (the default when `model` is given)
    model: str | None = None  # the draft model
    prompt_lookup_max: int = 4  # n-gram: the longest suffix n-gram looked up
    prompt_lookup_min: int = 1  # n-gram: the shortest
    # no speculation in a step with more running requests than this (None: always speculate)
    disable_by_batch_size: int | None = None
    # verify rounds per step: the worker verifies its own next proposals again (num_rounds - 1
    # more times) before it reports, so the round trip through the scheduler is paid once per
    # num_rounds verifies (at batch 1 it costs about as much as a verify); tokens then reach
    # the client in larger bursts
    num_rounds: int = 1
    # n-gram rounds of plain greedy requests on the device, one sync a step, every verify at
    # its full 1 + k rows (worker/ngram_rounds.py); off: the host's loop, a sync a round, each
    # verify as wide as its drafts. Off by default: on an H100 neither was faster than the
    # other beyond the spread between engines (scripts/results/session23_h100.md)
    rounds_on_device: bool = False

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "draft_model" if self.model is not None else "ngram"
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"unknown speculative method {self.method!r}; expected one of {SPECULATIVE_METHODS}"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if self.method == "draft_model" and self.model is None:
            raise ValueError("speculative method 'draft_model' needs a draft `model`")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.num_rounds < 1:
            raise ValueError("num_rounds must be at least 1")

    @property
    def lookahead_slots(self) -> int:
        """KV slots beyond a step's tokens that the worker writes: the further rounds' tokens
        (1 + k each) and a draft model's k decodes."""
        k = self.num_speculative_tokens
        return (self.num_rounds - 1) * (1 + k) + (k if self.method == "draft_model" else 0)


POOLING_TYPES = ("LAST", "MEAN", "CLS")


class PoolerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How an embedding pools the prompt's final hidden states into one vector, vLLM's
    `pooler_config`: {"pooling_type": "MEAN", "normalize": false}. LAST: the last prompt
    token's; MEAN: the mean over every prompt token; CLS: the first token's. `normalize`: the
    vector (after PoolingParams.dimensions) is scaled to unit length, unless a request says
    otherwise. Unset fields come from the model directory's sentence-transformers layout
    (models/pooling_layout.py), else LAST with normalize (vLLM's default for decoder models);
    `EngineConfig.resolve()` fills them."""

    pooling_type: str | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            if self.pooling_type.upper() not in POOLING_TYPES:
                raise ValueError(
                    f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                    f"got {self.pooling_type!r}"
                )
            self.pooling_type = self.pooling_type.upper()

    @property
    def pools_every_position(self) -> bool:
        """Whether a request needs positions before its last (MEAN, CLS): it takes no
        prefix-cache hit, whose positions would never run."""
        return self.pooling_type in ("MEAN", "CLS")

    def resolved(self, model_path: str) -> PoolerConfig:
        """The fields left unset filled from the model directory, or vLLM's defaults."""
        if self.pooling_type is not None and self.normalize is not None:
            return self
        layout = model_pooling(model_path)
        pooling_type, normalize = self.pooling_type, self.normalize
        if pooling_type is None:
            pooling_type = (layout.pooling_type() if layout is not None else None) or "LAST"
        if normalize is None:
            normalize = layout.normalize if layout is not None else True
        return PoolerConfig(pooling_type=pooling_type, normalize=normalize)


def pooler_config(value: dict) -> PoolerConfig:
    """A PoolerConfig from vLLM's dict form; ValueError with a clear message otherwise."""
    try:
        return msgspec.convert(value, PoolerConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid pooler_config: {exc}") from None


EXECUTOR_BACKENDS = ("mp", "ray")
BUS_SPIN_US, SPIN_MIN_CPUS = 1000, 8  # EngineConfig.bus_spin_us's default where it spins


class NetworkConfig(msgspec.Struct, kw_only=True):
    """Where the sockets of an engine spread over machines live (the supervisor fills it in
    for the Ray executor; actors/network.py is the one place that reads it): every bound
    socket is on tcp://host:base_port + k (addresses.Addresses), torch.distributed's rendezvous
    store on tcp://host:rendezvous_port. `host` is the machine that runs the supervisor."""

    host: str
    base_port: int
    rendezvous_port: int


class SupervisionConfig(msgspec.Struct, kw_only=True):
    """How the supervisor watches and restarts actors (actors/supervisor.py)."""

    heartbeat_interval_s: float = 1.0
    # An actor whose heartbeats stop, or whose loop has not run, for this long is hung: the
    # supervisor kills and restarts it ...
    heartbeat_timeout_s: float = 20.0
    # ... but a loop inside a declared blocking call (a worker's step, which may compile
    # kernels) gets this long.
    blocking_timeout_s: float = 600.0
    # Restarts of one actor allowed within the window (a rate: a crash loop ends) ...
    restart_budget: int = 20
    restart_window_s: float = 60.0
    # ... and starts in a row that may fail (die or time out before ready) before giving up.
    max_failed_starts: int = 3
    restart_ready_timeout_s: float = 120.0
    # Keep one pre-started process per restartable actor with its imports done, so that a
    # restart skips them (seconds for torch or transformers).
    standby_processes: bool = True


class EngineConfig(msgspec.Struct, kw_only=True):
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # the linear layers' weights: None (the checkpoint's own quantization_config, if any) or
    # one of QUANTIZATION_METHODS
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 (E4M3, per-tensor scales)
    load_format: str = "auto"  # auto | safetensors | dummy
    seed: int = 0
    max_model_len: int | None = None
    # vLLM's: the layers with a sliding window attend over the whole context instead, which
    # is then capped to the window (the model's own attention within it)
    disable_sliding_window: bool = False
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    # Requests allowed to wait for the running set; beyond it the engine answers 503
    # (admission control). None: scaled to max_num_seqs and the KV cache.
    max_waiting_requests: int | None = None
    # fcfs: waiting requests admitted in arrival order; priority: by (priority, arrival), a
    # request's `priority` (lower first, vLLM's), running ones preempted lowest priority first
    scheduling_policy: str = "fcfs"
    # most logprobs (top tokens per position) a request may ask for, output or prompt (vLLM's)
    max_logprobs: int = 20
    num_kv_blocks: int | None = None  # override the memory-derived number of KV blocks
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    device: str = "auto"  # auto | cpu | cuda
    attention_backend: str = "auto"  # auto (cuda on a GPU, else torch) | torch | triton | cuda
    tensor_parallel_size: int = 1
    # Pipeline stages (a TP x PP grid of workers: see layout.py) and, for uneven splits, the
    # decoder layers of each stage (None: as even as possible)
    pipeline_parallel_size: int = 1
    pipeline_layer_partition: list[int] | None = None
    # Where the workers run: mp (processes on this machine) or ray (Ray actors across the
    # machines of an existing Ray cluster; `pip install pagedserve[ray]`)
    distributed_executor_backend: str = "mp"
    # Deadline of one collective or transfer between workers: a dead or hung rank ends the
    # step with an error, never a wait without end
    collective_timeout_s: float = 300.0
    network: NetworkConfig | None = None  # set by the supervisor (Ray); None: ipc sockets
    # Plans at the workers at once: 1 = no overlap; 2 = the scheduler plans step N+1 while N
    # runs; 3 = also the worker launches N+1 on the device before N's tokens reach the host.
    max_inflight_steps: int = 3
    # How long the scheduler and the workers check their inbox in a loop before their thread
    # sleeps (a sleeping thread waits for the CPU to wake it: a 256-request plan's round trip
    # took 120 µs sleeping and 96 µs spinning on an H100 host). None: BUS_SPIN_US on a GPU
    # machine with SPIN_MIN_CPUS CPUs or more (cores to spare), else 0 (on a 2-CPU machine
    # spinning starved ZeroMQ's I/O threads: 1.2 ms round trips)
    bus_spin_us: int | None = None
    enforce_eager: bool = False
    # CUDA: a lone request's prompt chunk of up to max(these) tokens replays a graph of the
    # next size here, whatever max_num_seqs is (actors/worker/prefill_graphs.py; sizes above
    # the longest chunk are dropped); empty: such chunks run as decode-graph rows
    prefill_graph_sizes: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    # CUDA bf16/fp16: x W^T for products of at most small_batch_gemm_rows rows by the Triton
    # weight-streaming GEMM (kernels/triton_gemv.py, up to 16 rows) instead of cuBLAS; at 1 it
    # takes batch-1 decode steps only (on the H200 it beat cuBLAS at 1 row and lost at 4 on
    # Llama-3.1-8B's and Qwen3-0.6B's shapes: scripts/results/kernels_h200.md)
    small_batch_gemm: bool = True
    small_batch_gemm_rows: int = 1
    # CUDA, quantized weights (int4 / int8 / fp8): products of <= 16 rows (decode) by the CUDA
    # C++ weight-only GEMV (kernels/cuda_quant.py, built at install for sm_90+) where it is
    # built; off, or not built: the Triton quantized GEMV
    cuda_quant_gemv: bool = True
    # CUDA sm_90+: the decode path's kernels (RMSNorm, q/k rotary, SiLU-and-mul, the small-batch
    # and quantized GEMVs, the CUDA decode attention) launch as programmatic dependents (PDL):
    # each is resident and prefetches its weights while the kernel before it drains, and waits
    # for it in-kernel (csrc/grid_dependency.h); also inside CUDA graphs
    dependent_launch: bool = True
    # CPU: the C++ kernels of csrc/cpu_kernels.cpp (AVX-512 / AVX2 machines) where they load; off:
    # the pure-torch paths (the same math)
    cpu_kernels: bool = True
    # CUDA: compile the start-up's Triton kernels in parallel threads, by a compile-only dry run
    # of its steps, before running them (kernels/compile_ahead.py)
    compile_kernels_ahead: bool = True
    run_dir: str | None = None  # where ipc:// sockets live; a private temp dir by default
    log_level: str = "WARNING"
    server: ServerConfig | None = None
    skip_tokenizer_init: bool = False  # token ids in and out only (models with no tokenizer)
    profile: ProfileConfig | None = None  # profile a window of worker steps (rank 0)
    speculative_config: SpeculativeConfig | None = None
    # LoRA adapters (LoRARequest): up to max_loras in a step, of rank up to max_lora_rank
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    # vLLM's --hf-overrides: config.json fields replaced, e.g. a YaRN rope_scaling
    hf_overrides: dict[str, Any] | None = None
    chat_template: str | None = None  # a Jinja chat template replacing the tokenizer's
    generation_config: str = "auto"  # defaults from generation_config.json: auto | vllm | DIR
    # vLLM's --override-generation-config: generation_config.json keys over its values
    override_generation_config: dict[str, Any] | None = None
    tokenizer_mode: str = "auto"  # auto (the fast tokenizer where there is one) | slow
    trust_remote_code: bool = False  # accepted for vLLM compatibility: only local code runs
    # embeddings (PoolingParams): how a prompt is pooled; unset fields filled by resolve()
    pooler_config: PoolerConfig = msgspec.field(default_factory=PoolerConfig)
    supervision: SupervisionConfig = msgspec.field(default_factory=SupervisionConfig)

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):  # LLM(speculative_config={...})
            self.speculative_config = speculative_config(self.speculative_config)
        if isinstance(self.pooler_config, dict):  # LLM(pooler_config={...}), --pooler-config
            self.pooler_config = pooler_config(self.pooler_config)
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.tensor_parallel_size <= 0:
            raise ValueError("tensor_parallel_size must be positive")
        if self.pipeline_parallel_size <= 0:
            raise ValueError("pipeline_parallel_size must be positive")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                f"got {self.distributed_executor_backend!r}"
            )
        if self.collective_timeout_s <= 0:
            raise ValueError("collective_timeout_s must be positive")
        if self.max_inflight_steps not in (1, 2, 3):
            raise ValueError("max_inflight_steps must be 1, 2 or 3")
        if self.bus_spin_us is not None and not 0 <= self.bus_spin_us <= 1_000_000:
            raise ValueError("bus_spin_us must be between 0 and 1,000,000")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be at least 1")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be at least 1")
        if self.enable_lora and self.speculative_config is not None:
            raise ValueError("LoRA adapters and speculative decoding do not combine")
        if self.override_generation_config is not None and not isinstance(
            self.override_generation_config, dict
        ):
            raise ValueError("override_generation_config must be a JSON object")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError("hf_overrides must be a JSON object of config.json fields")
        if self.max_logprobs < 0:
            raise ValueError("max_logprobs must be at least 0")
        if self.scheduling_policy not in ("fcfs", "priority"):
            policy = self.scheduling_policy
            raise ValueError(f"scheduling_policy must be fcfs or priority, not {policy!r}")
        if not 1 <= self.small_batch_gemm_rows <= 16:
            raise ValueError("small_batch_gemm_rows must be between 1 and 16")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"unknown load_format {self.load_format!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"unknown quantization {self.quantization!r}; expected one of "
                f"{', '.join(QUANTIZATION_METHODS)}"
            )
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(
                f"tokenizer_mode {self.tokenizer_mode!r} is not supported; expected one of "
                f"{', '.join(TOKENIZER_MODES)}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; expected one of "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )

    @property
    def world_size(self) -> int:
        """Workers: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def spin_seconds(self) -> float:
        """The inboxes' spin (bus_spin_us) of a resolved config, in seconds."""
        return (self.bus_spin_us or 0) / 1e6

    @property
    def model_path(self) -> str:
        return resolve_model_path(self.model)

    @property
    def tokenizer_path(self) -> str:
        return resolve_model_path(self.tokenizer or self.model)

    def resolve(self) -> EngineConfig:
        """Fill the fields that depend on the model (max_model_len) and the machine (device)."""
        hf = read_hf_config(self.model_path, self.hf_overrides)
        if self.speculative_config is not None:
            check_draft_model(self.speculative_config, hf)
        limit = context_limit(hf)
        window = active_sliding_window(hf)
        if self.disable_sliding_window and window is not None and window < limit:
            logger.warning(
                "disable_sliding_window: the context is capped to the window (%d tokens), "
                "within which full attention is the model's", window
            )  # fmt: skip
            limit = window
        max_len = min(self.max_model_len or limit, limit)
        device = self.device
        if device == "auto":
            device = "cuda" if _cuda_available() else "cpu"
        backend = self.attention_backend
        if backend == "auto":  # the CUDA C++ decode kernel measured fastest on an H200
            backend = "cuda" if device == "cuda" else "torch"
        local_gpus = device == "cuda" and self.distributed_executor_backend == "mp"
        check_layout(self, hf, _cuda_device_count() if local_gpus else None)
        spin_us = self.bus_spin_us
        if spin_us is None:
            spin_us = default_bus_spin_us(device, usable_cpus())
        return msgspec.structs.replace(
            self,
            max_model_len=max_len,
            device=device,
            attention_backend=backend,
            bus_spin_us=spin_us,
            pooler_config=self.pooler_config.resolved(self.model_path),
            max_num_batched_tokens=max(self.max_num_batched_tokens, self.max_num_seqs),
        )


def default_bus_spin_us(device: str, num_cpus: int) -> int:
    """EngineConfig.bus_spin_us where it is left unset: spin on a GPU machine with cores to
    spare (a CPU engine's worker needs every core for its kernels)."""
    return BUS_SPIN_US if device == "cuda" and num_cpus >= SPIN_MIN_CPUS else 0


def speculative_config(value: dict) -> SpeculativeConfig:
    """A SpeculativeConfig from vLLM's dict form; ValueError with a clear message otherwise."""
    try:
        return msgspec.convert(value, SpeculativeConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid speculative_config: {exc}") from None


def check_draft_model(spec: SpeculativeConfig, target_hf_config: dict) -> None:
    """A draft model must exist and share the target's vocabulary."""
    if spec.model is None:
        return
    draft = read_hf_config(resolve_model_path(spec.model))
    if draft.get("vocab_size") != target_hf_config.get("vocab_size"):
        raise ValueError(
            f"the draft model {spec.model!r} has a vocabulary of {draft.get('vocab_size')} "
            f"tokens, the target {target_hf_config.get('vocab_size')}: a draft must share the "
            "target's tokenizer"
        )


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


# what a GPU driver torch can use creates: NVIDIA's (its control device, or its proc entry in a
# container), WSL2's GPU paravirtualization, ROCm's compute device
GPU_DRIVER_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg", "/dev/kfd")


def _cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch (~2 s before any actor starts) on a
    machine that has no GPU driver at all."""
    if not any(os.path.exists(path) for path in GPU_DRIVER_PATHS):
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a dependency
        return False


def resolve_model_path(name: str) -> str:
    """A local directory, the embedded default model, or a hub id already in the local cache."""
    if name == DEFAULT_MODEL:
        return str(ASSETS_DIR / "tiny-shakespeare")
    if os.path.isdir(name):
        return name
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, local_files_only=True)
    except Exception as exc:
        raise ValueError(
            f"model {name!r} is neither a local directory nor a hub id in the local cache"
        ) from exc


def read_hf_config(model_path: str, overrides: dict[str, Any] | None = None) -> dict:
    """config.json as a dict, with `overrides` (EngineConfig.hf_overrides) over its fields
    (and what they imply of a score head made from the LM head: `with_score_head_method`)."""
    with open(os.path.join(model_path, "config.json")) as f:
        return with_score_head_method(json.load(f) | (overrides or {}))
