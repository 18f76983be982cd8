"""The per-token layers the models are written against: RMSNorm, rotary embedding,
SiLU-and-mul and paged attention (the linear layers are in models.linear).

Each takes the model's LayerConfig at construction and keeps what it decides: which
implementation of its op runs (`fused_ops`: Triton, the C++ CPU kernels or pure torch) and, for
attention, the backend's functions.
"""

from __future__ import annotations

import functools
import math
from types import ModuleType
from typing import TYPE_CHECKING, overload

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from pagedserve.kernels.triton_ops import KVWrite

from pagedserve.kernels.attention_metadata import AttentionMetadata, OutputRows
from pagedserve.kernels.ops import (
    apply_rotary_full,
    fused_add_rms_norm_fast,
    rms_norm_fast,
    rotary_tables,
    silu_and_mul,
)
from pagedserve.models.layer_config import FusedOps, LayerConfig, TensorParallel
from pagedserve.models.weights import (
    VECTOR,
    OutputShard,
    ParamLayout,
    default_weight_loader,
    load_shard,
    new_parameter,
)

SCALAR = ParamLayout(output_dim=None, input_dim=None)


@functools.cache
def triton_ops_module() -> ModuleType:
    """kernels.triton_ops, imported on first use (by a layer whose config chose Triton)."""
    from pagedserve.kernels import triton_ops

    return triton_ops


def cpu_kernel_takes(x: torch.Tensor) -> bool:
    """Whether the C++ CPU kernels (fused_ops "cpu") take x: rows contiguous in the last dim,
    no autograd (the kernels have none)."""
    return x.stride(-1) == 1 and not torch.is_grad_enabled()


class RMSNorm(nn.Module):
    """RMSNorm; with a residual it fuses the add: forward(x, residual) -> (normed, x + residual).
    On the C++ CPU path and on the Triton path (when x and residual are contiguous and the weight
    has x's dtype) the fused form works in place: residual becomes x + residual and x the normed
    values (the decoder layers hand both over and use only the returned tensors)."""

    def __init__(self, hidden_size: int, eps: float, config: LayerConfig) -> None:
        super().__init__()
        self.eps = eps
        self.fused_ops = config.fused_ops
        self.dependent_launch = config.dependent_launch
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.fused_ops == "triton" and (
            residual is None or (residual.shape == x.shape and residual.dtype == x.dtype)
        ):
            triton_ops = triton_ops_module()
            pdl = self.dependent_launch
            if residual is None:
                return triton_ops.rms_norm(x, self.weight, self.eps, dependent_launch=pdl)
            inplace = (
                self.weight.dtype == x.dtype and x.is_contiguous() and residual.is_contiguous()
            )
            return triton_ops.fused_add_rms_norm(
                x, residual, self.weight, self.eps, inplace, dependent_launch=pdl
            )
        if self.fused_ops == "cpu" and x.dim() == 2 and cpu_kernel_takes(x):
            if residual is None:
                out = torch.empty_like(x)
                torch.ops.pagedserve_cpu.rms_norm(out, x, self.weight, self.eps)
                return out
            if residual.stride(-1) == 1 and residual.dtype == torch.float32:
                torch.ops.pagedserve_cpu.fused_add_rms_norm(x, residual, self.weight, self.eps)
                return x, residual
        if residual is None:
            return rms_norm_fast(x, self.weight, self.eps)
        return fused_add_rms_norm_fast(x, residual, self.weight, self.eps)


def rope_inverse_frequencies(
    rotary_dim: int, rope_theta: float, rope_scaling: dict | None, context_len: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention factor): inv_freq[i] = theta^(-2i / rotary_dim), adjusted by
    `rope_type` (default, linear, llama3, yarn, longrope); the factor scales cos and sin
    (YaRN's and LongRoPE's, else 1). context_len: the engine's longest context (LongRoPE picks
    its factors by it)."""
    powers = rope_theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
    inv_freq = 1.0 / powers
    scaling = rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inverse_frequencies(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inverse_frequencies(inv_freq, rope_theta, scaling)
    if rope_type == "longrope":
        return _longrope_inverse_frequencies(powers, scaling, context_len)
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported")


def _longrope_inverse_frequencies(
    powers: torch.Tensor, scaling: dict, context_len: int
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini), as transformers' _compute_longrope_parameters:
    inv_freq[i] = 1 / (factors[i] * powers[i]) (powers[i] = theta^(2i / rotary_dim)) with the
    `long_factor` or `short_factor` list; cos and sin scaled by
    sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) (1 for a factor up to 1), or
    the config's attention_factor. `scaling` holds original_max_position_embeddings and factor
    (`llama.rope_settings` fills them in as transformers does).

    The factors are chosen once, as vLLM does (Phi3LongRoPEScaledRotaryEmbedding): the long ones
    when the engine's context (max_model_len) exceeds original_max_position_embeddings, else the
    short ones, so that cached keys stay valid as a sequence grows. transformers instead picks
    per forward by the sequence's length (short up to original_max_position_embeddings tokens,
    long past them, recomputing the cache when a generation crosses over): the two agree on
    every sequence longer than that, and on all when max_model_len is at most that."""
    original = scaling["original_max_position_embeddings"]
    use_long = context_len > original
    factors = torch.tensor(scaling["long_factor" if use_long else "short_factor"])
    if factors.shape != powers.shape:
        raise ValueError(
            f"LongRoPE needs {len(powers)} factors (half the rotary dims), got {len(factors)}"
        )
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        factor = scaling["factor"]
        attention_factor = (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    return 1.0 / (factors.float() * powers), float(attention_factor)


def _yarn_inverse_frequencies(
    inv_freq: torch.Tensor, rope_theta: float, scaling: dict
) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071), as transformers computes it: the frequencies that turn fewer
    than beta_slow times over the original context are divided by `factor` (interpolated),
    those that turn more than beta_fast times are kept (extrapolated), a linear ramp between;
    cos and sin are scaled by 0.1 ln(factor) + 1 (or the ratio of two such mscales, or the
    config's attention_factor). `scaling` holds original_max_position_embeddings and factor
    (`llama.rope_settings` fills them in as transformers does)."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    dim = 2 * len(inv_freq)

    def turns_to_dim(turns: float) -> float:  # the dimension that turns `turns` times
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(rope_theta))

    low, high = (
        turns_to_dim(scaling.get("beta_fast") or 32),
        turns_to_dim(scaling.get("beta_slow") or 1),
    )
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no empty ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # the share of the extrapolated (original) frequency
    inv_freq = inv_freq / factor * (1 - kept) + inv_freq * kept
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return inv_freq, float(attention_factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE over the first `rotary_dim` dims of each head (all of them, or a
    fraction: partial rotary, the rest passed through); cos/sin cached per position (float32
    math, stored in the default dtype at construction time, i.e. the model dtype). The per-step
    tables (looked up at the step's positions) are kept for as long as the same positions
    tensor object comes back (and, outside inference mode, is unmodified) within one forward:
    every layer shares this module, so one lookup serves them all. The model calls `new_step`
    at the start of every forward, so each forward's first layer looks them up again: a CUDA
    graph captured after eager warm-up runs with the same positions tensor must record the
    lookup, not reuse the warm-up's tables. Positions are never edited in place (an inference
    tensor has no version counter to tell)."""

    def __init__(
        self,
        rotary_dim: int,
        max_position: int,
        rope_theta: float,
        rope_scaling: dict | None,
        config: LayerConfig,
    ) -> None:
        super().__init__()
        self.fused_ops: FusedOps = config.fused_ops
        self.dependent_launch = config.dependent_launch
        self.rotary_dim = rotary_dim
        context_len = config.max_model_len or max_position
        inv_freq, factor = rope_inverse_frequencies(
            rotary_dim, rope_theta, rope_scaling, context_len
        )
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        dtype = torch.get_default_dtype()
        self.register_buffer("cos_cache", (freqs.cos() * factor).to(dtype), persistent=False)
        self.register_buffer("sin_cache", (freqs.sin() * factor).to(dtype), persistent=False)
        self._step: tuple[torch.Tensor, int, torch.Tensor, torch.Tensor] | None = None

    def new_step(self) -> None:
        """Forget the per-step tables: the next `tables` call looks them up again."""
        self._step = None

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, rotary_dim] (cat(cos, cos), cat(-sin, sin)) at `positions` [T]."""
        step = self._step
        version = 0 if positions.is_inference() else positions._version
        if step is None or step[0] is not positions or step[1] != version:
            cos, sin = rotary_tables(self.cos_cache[positions], self.sin_cache[positions])
            step = self._step = (positions, version, cos, sin)
        return step[2], step[3]

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] (any view) -> a new tensor, its first rotary_dim dims of
        each head rotated, the others copied."""
        cos, sin = self.tables(positions)
        if x.shape[-1] == self.rotary_dim:
            return apply_rotary_full(x, cos, sin)
        rotated = apply_rotary_full(x[..., : self.rotary_dim], cos, sin)
        return torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1)

    def rotate_(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """rotate, in place on x (one C++ pass on the CPU path); returns x."""
        rotary = x[..., : self.rotary_dim]  # a view: the dims rotary changes
        if (
            self.fused_ops == "cpu"
            and cpu_kernel_takes(rotary)
            and self.cos_cache.dtype == torch.float32
            and positions.dtype == torch.int64
            and positions.is_contiguous()
        ):
            torch.ops.pagedserve_cpu.rotary_inplace(
                rotary, positions, self.cos_cache, self.sin_cache
            )
            return x
        rotary.copy_(self.rotate(positions, rotary))
        return x

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, num_heads, head_dim]; k [T, num_kv_heads, head_dim]."""
        return self.rotate(positions, q), self.rotate(positions, k)

    def norm_rotate_qk(
        self,
        positions: torch.Tensor,
        qk: torch.Tensor,
        num_q_heads: int,
        qk_norms: tuple[RMSNorm, RMSNorm] | None = None,
        kv_write: KVWrite | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """qk [T, q_heads + kv_heads, head_dim] (q heads first; a view of this step's own qkv
        buffer, which may be overwritten) -> (q, k, kv_written): with qk_norms = (q_norm,
        k_norm) each head normed first (Qwen3), then rotated (its first rotary_dim dims). The
        Triton path is one launch in place on qk, which also writes the paged KV cache when
        given kv_write (kv_written says it did); the other paths rotate in place (no norms) or
        build new q and k."""
        if self.fused_ops == "triton" and (qk_norms is None or qk_norms[0].eps == qk_norms[1].eps):
            weights: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
            eps = 1e-6
            if qk_norms is not None:
                weights, eps = (qk_norms[0].weight, qk_norms[1].weight), qk_norms[0].eps
            triton_ops_module().qk_norm_rotary_(
                qk, positions, self.cos_cache, self.sin_cache, *weights, eps,
                num_q_heads=num_q_heads, kv_write=kv_write, rotary_dim=self.rotary_dim,
                dependent_launch=self.dependent_launch,
            )  # fmt: skip
            return qk[:, :num_q_heads], qk[:, num_q_heads:], kv_write is not None
        if qk_norms is None:
            qk = self.rotate_(positions, qk)
            return qk[:, :num_q_heads], qk[:, num_q_heads:], False
        q_norm, k_norm = qk_norms
        q, k = q_norm(qk[:, :num_q_heads]), k_norm(qk[:, num_q_heads:])
        return *self(positions, q, k), False


class SiluAndMul(nn.Module):
    def __init__(self, config: LayerConfig) -> None:
        super().__init__()
        self.fused_ops: FusedOps = config.fused_ops
        self.dependent_launch = config.dependent_launch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_ops == "triton":
            return triton_ops_module().silu_and_mul(x, dependent_launch=self.dependent_launch)
        if self.fused_ops == "cpu" and x.dim() == 2 and cpu_kernel_takes(x):
            out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
            torch.ops.pagedserve_cpu.silu_and_mul(out, x)
            return out
        return silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """gelu(gate, tanh approximation) * up over [T, 2 d] -> [T, d] (Gemma's GeGLU), in torch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def load_head_shard(tp: TensorParallel, param: nn.Parameter, loaded: torch.Tensor) -> None:
    """A per-head checkpoint tensor [total heads] into this tensor-parallel rank's
    parameter [local heads]: its heads rank * local .. (rank + 1) * local (VECTOR layout)."""
    local = param.shape[0]
    if loaded.shape != (local * tp.size,):
        raise ValueError(
            f"a per-head tensor of {local * tp.size} heads expected, got {tuple(loaded.shape)}"
        )
    load_shard(param, loaded, OutputShard(0, tp.rank * local, local), None)


class Attention(nn.Module):
    """Writes this step's k/v into the layer's paged cache, then paged attention over it, by
    the config's attention backend. The model runner assigns `k_cache` / `v_cache` (one
    layer's caches in the backend's layout, of config.cache_dtype). An fp8 cache has a scale
    for k and one for v (kernels.kv_quant): parameters `k_scale` / `v_scale` that a checkpoint
    may fill (1.0 otherwise), read once after loading into `kv_scales`. With `sinks` (GPT-OSS)
    the layer has a learned sink logit per head: the float32 parameter `sinks` [num_heads]
    (this rank's heads of the checkpoint's), passed to the backend at every step."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        config: LayerConfig,
        window: int = 0,
        softcap: float = 0.0,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.backend = config.attention
        # a sliding window, a logit softcap and attention sinks (kernels.attention_ref's doc),
        # when the layer has them
        if (window or softcap or sinks) and not self.backend.windowed:
            raise ValueError(
                f"the {self.backend.name!r} attention backend has no sliding window, softcap or "
                "attention sinks"
            )
        self.options: dict[str, int | float | torch.Tensor] = (
            {"window": window, "softcap": softcap} if window or softcap else {}
        )
        self.sinks: nn.Parameter | None = None
        if sinks:  # loaded in place: the options hold the parameter itself
            loader = functools.partial(load_head_shard, config.tp)
            self.sinks = new_parameter(num_heads, loader=loader, dtype=torch.float32,
                                       layout=VECTOR)  # fmt: skip
            self.options["sinks"] = self.sinks
        fp8_cache = config.cache_dtype == torch.float8_e4m3fn
        # the q/k rotary launch writes the cache (Triton ops, a backend with Triton's write, a
        # cache of the model's dtype)
        self.fuses_kv_write = (
            config.fused_ops == "triton" and self.backend.fuses_kv_write and not fp8_cache
        )
        self.kv_scales = (1.0, 1.0)
        if fp8_cache:
            for name in ("k_scale", "v_scale"):
                param = new_parameter(loader=default_weight_loader, dtype=torch.float32,
                                      layout=SCALAR, optional=True)  # fmt: skip
                self.register_parameter(name, param)
                param.data.fill_(1.0)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def fusable_kv_write(self, v: torch.Tensor, metadata: AttentionMetadata) -> KVWrite | None:
        """The cache write for the q/k rotary kernel to do in its launch (the Triton path on
        a backend whose cache write is Triton's), or None."""
        if not self.fuses_kv_write:
            return None
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return triton_ops_module().KVWrite(v, self.k_cache, self.v_cache, metadata.slot_mapping)

    def process_weights_after_loading(self) -> None:
        if hasattr(self, "k_scale"):
            self.kv_scales = (float(self.k_scale), float(self.v_scale))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata,
        output_rows: OutputRows | None = None,
        kv_written: bool = False,
    ) -> torch.Tensor:
        """q [T, heads * dim], k/v [T, kv_heads * dim] -> [T, heads * dim]; with output_rows,
        every row's k/v is cached but only those rows attend -> [n, heads * dim]. kv_written:
        this step's k/v are in the cache already (see fusable_kv_write)."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if not kv_written:
            self.backend.write_kv_cache(
                k, v, self.k_cache, self.v_cache, metadata.slot_mapping, *self.kv_scales
            )
        if output_rows is not None:
            q, metadata = q.index_select(0, output_rows.indices), output_rows.metadata
        out = self.backend.attend(q, self.k_cache, self.v_cache, metadata, self.scale,
                                  *self.kv_scales, **self.options)  # fmt: skip
        return out.reshape(-1, self.num_heads * self.head_dim)
