"""One typed configuration object, passed explicitly to every actor.

`EngineConfig` is a msgspec Struct so that it crosses process boundaries as plain bytes
(`encode_config` / `decode_config`), the same codec the bus uses. `resolve()` fills every
"auto" field from the model directory once, in the parent process, so each actor sees the
same concrete values.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec

DEFAULT_MODEL = "pagedserve/tiny-shakespeare"
ASSETS_DIR = Path(__file__).parent / "assets"


class ServerConfig(msgspec.Struct, kw_only=True):
    """The HTTP server's settings (`pagedserve serve`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None


class ProfileConfig(msgspec.Struct, kw_only=True):
    """Profiling of rank 0's worker (see actors/worker/profiling.py): a torch.profiler window
    over `num_steps` steps (0: none), the actors' loop timers, and a log of every step (its
    shape, host and device time, Triton compiles)."""

    output_dir: str
    first_step: int = 200  # launches skipped first (warm-up, the prefill burst)
    num_steps: int = 20


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
    load_format: str = "auto"  # auto | safetensors | dummy
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    # Requests allowed to wait for the running set; beyond it the engine answers 503
    # (admission control). None: scaled to max_num_seqs and the KV cache.
    max_waiting_requests: int | None = None
    num_kv_blocks: int | None = None  # override the memory-derived number of KV blocks
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    device: str = "auto"  # auto | cpu | cuda
    attention_backend: str = "auto"  # auto (cuda on a GPU, else torch) | torch | triton | cuda
    tensor_parallel_size: int = 1
    # Plans at the workers at once: 1 = no overlap; 2 = the scheduler plans step N+1 while N
    # runs; 3 = also the worker launches N+1 on the device before N's tokens reach the host.
    max_inflight_steps: int = 3
    enforce_eager: bool = False
    # CUDA bf16/fp16: x W^T for batches of <= 16 rows (decode) by the Triton weight-streaming
    # GEMM (kernels/triton_gemv.py) instead of cuBLAS
    small_batch_gemm: bool = True
    # CUDA: compile the start-up's Triton kernels in parallel threads, by a compile-only dry run
    # of its steps, before running them (kernels/compile_ahead.py)
    compile_kernels_ahead: bool = True
    run_dir: str | None = None  # where ipc:// sockets live; a private temp dir by default
    log_level: str = "WARNING"
    server: ServerConfig | None = None
    skip_tokenizer_init: bool = False  # token ids in and out only (models with no tokenizer)
    profile: ProfileConfig | None = None  # profile a window of worker steps (rank 0)
    supervision: SupervisionConfig = msgspec.field(default_factory=SupervisionConfig)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.tensor_parallel_size <= 0:
            raise ValueError("tensor_parallel_size must be positive")
        if self.max_inflight_steps not in (1, 2, 3):
            raise ValueError("max_inflight_steps must be 1, 2 or 3")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"unknown load_format {self.load_format!r}")

    @property
    def model_path(self) -> str:
        return resolve_model_path(self.model)

    @property
    def tokenizer_path(self) -> str:
        return resolve_model_path(self.tokenizer or self.model)

    def resolve(self) -> EngineConfig:
        """Fill the fields that depend on the model (max_model_len) and the machine (device)."""
        hf = read_hf_config(self.model_path)
        limit = hf.get("max_position_embeddings") or 2048
        max_len = min(self.max_model_len or limit, limit)
        device = self.device
        if device == "auto":
            device = "cuda" if _cuda_available() else "cpu"
        backend = self.attention_backend
        if backend == "auto":  # the CUDA C++ decode kernel measured fastest on an H200
            backend = "cuda" if device == "cuda" else "torch"
        return msgspec.structs.replace(
            self,
            max_model_len=max_len,
            device=device,
            attention_backend=backend,
            max_num_batched_tokens=max(self.max_num_batched_tokens, self.max_num_seqs),
        )


def _cuda_available() -> bool:
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


def read_hf_config(model_path: str) -> dict:
    with open(os.path.join(model_path, "config.json")) as f:
        return json.load(f)


_codec_encoder = msgspec.msgpack.Encoder()
_codec_decoder = msgspec.msgpack.Decoder(EngineConfig)


def encode_config(config: EngineConfig) -> bytes:
    return _codec_encoder.encode(config)


def decode_config(data: bytes) -> EngineConfig:
    return _codec_decoder.decode(data)
