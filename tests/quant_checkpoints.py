"""Quantized checkpoints written the way the published tools write them, for the loader's tests:
a float model directory's linear weights quantized by round-to-nearest here and stored in the
Hugging Face layouts of GPTQ (AutoGPTQ / GPTQModel), AWQ (GEMM), compressed-tensors and vLLM's
FP8, with their quantization_config. The packing is written from the formats' descriptions,
independently of the engine's unpacking code.

Each writer returns, per quantized tensor name, the dequantized float weight the checkpoint
stands for (what the engine must compute with).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import record_tokenizer_class

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the column packed at nibble i of a word
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear_weights(state: dict[str, torch.Tensor]) -> list[str]:
    return [name for name in state if name.endswith(".weight") and
            name.split(".")[-2] in LINEARS]  # fmt: skip


def rtn(
    w: torch.Tensor, bits: int, groups: torch.Tensor, num_groups: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round to nearest, per output row and group (groups[k]: column k's group): unsigned codes
    [N, K], scales [N, G], integer zero points [N, G]."""
    w = w.double()
    n, top = w.shape[0], 2**bits - 1
    scales, zeros = torch.empty(n, num_groups, dtype=torch.float64), torch.empty(n, num_groups)
    for g in range(num_groups):
        cols = w[:, groups == g]
        if symmetric:
            scales[:, g] = (cols.abs().amax(1) / (2 ** (bits - 1) - 1)).clamp(min=1e-8)
            zeros[:, g] = 2 ** (bits - 1)
        else:
            low, high = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scales[:, g] = ((high - low) / top).clamp(min=1e-8)
            zeros[:, g] = torch.round(-low / scales[:, g]).clamp(0, top)
    scales = scales.half().double()  # the checkpoint stores fp16 scales
    codes = torch.round(w / scales[:, groups] + zeros[:, groups]).clamp(0, top)
    return codes.long(), scales, zeros.long()


def dequantized(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                groups: torch.Tensor) -> torch.Tensor:  # fmt: skip
    return ((codes - zeros[:, groups]) * scales[:, groups]).float()


def pack(values: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """32 / bits values an int32 along `dim`: element per_word * j + (order[i] or i) at bits
    * i of word j."""
    per_word = 32 // bits
    values = values.long().movedim(dim, 0)
    words = torch.zeros(values.shape[0] // per_word, *values.shape[1:], dtype=torch.int64)
    for i in range(per_word):
        words |= (values[(order[i] if order else i) :: per_word] & (2**bits - 1)) << (bits * i)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).movedim(0, dim).contiguous()


def _input_of(name: str) -> int:
    """A number for the input a linear module reads (shared by q / k / v, by gate / up)."""
    layer = int(name.split(".layers.")[1].split(".")[0])
    module = name.split(".")[-2]
    shared = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(module, module)
    return 10 * layer + LINEARS.index(shared)


def _write(source: Path, target: Path, state: dict[str, torch.Tensor], qconfig: dict) -> None:
    shutil.copytree(source, target)
    (target / "model.safetensors").unlink()
    save_file(state, target / "model.safetensors")
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = qconfig
    (target / "config.json").write_text(json.dumps(config))
    record_tokenizer_class(target)


def _group_index(k: int, group: int, act_order: bool, seed: int) -> torch.Tensor:
    """Column k's group: k // group, or (act-order) by position in a random permutation (GPTQ
    orders a layer's input channels by its inputs' statistics: one order for the modules that
    read the same input, q / k / v and gate / up)."""
    if not act_order:
        return torch.arange(k) // group
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    groups = torch.empty(k, dtype=torch.long)
    groups[perm] = torch.arange(k) // group
    return groups


def write_gptq(source: Path, target: Path, bits: int, group: int, symmetric: bool,
               act_order: bool) -> dict[str, torch.Tensor]:  # fmt: skip
    """GPTQ v1: qweight [K / f, N], qzeros [G, N / f] holding zero - 1, scales [G, N] fp16,
    g_idx [K] int32."""
    state = load_file(source / "model.safetensors")
    expected = {}
    for name in linear_weights(state):
        w = state.pop(name)
        k = w.shape[1]
        groups = _group_index(k, group, act_order, seed=_input_of(name))
        codes, scales, zeros = rtn(w, bits, groups, k // group, symmetric)
        prefix = name.removesuffix(".weight")
        state[f"{prefix}.qweight"] = pack(codes.t(), bits, dim=0)
        state[f"{prefix}.qzeros"] = pack((zeros - 1).t(), bits, dim=1)
        state[f"{prefix}.scales"] = scales.t().half().contiguous()
        state[f"{prefix}.g_idx"] = groups.to(torch.int32)
        expected[name] = dequantized(codes, scales, zeros, groups)
    qconfig = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
               "sym": symmetric, "checkpoint_format": "gptq", "true_sequential": True}  # fmt: skip
    _write(source, target, state, qconfig)
    return expected


def write_awq(source: Path, target: Path, group: int) -> dict[str, torch.Tensor]:
    """AWQ GEMM: qweight [K, N / 8] and qzeros [G, N / 8] in AWQ's order, scales [G, N]."""
    state = load_file(source / "model.safetensors")
    expected = {}
    for name in linear_weights(state):
        w = state.pop(name)
        groups = torch.arange(w.shape[1]) // group
        codes, scales, zeros = rtn(w, 4, groups, w.shape[1] // group, symmetric=False)
        prefix = name.removesuffix(".weight")
        state[f"{prefix}.qweight"] = pack(codes.t(), 4, dim=1, order=AWQ_ORDER)
        state[f"{prefix}.qzeros"] = pack(zeros.t(), 4, dim=1, order=AWQ_ORDER)
        state[f"{prefix}.scales"] = scales.t().half().contiguous()
        expected[name] = dequantized(codes, scales, zeros, groups)
    qconfig = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
               "version": "gemm", "modules_to_not_convert": None}  # fmt: skip
    _write(source, target, state, qconfig)
    return expected


def write_compressed_int(
    source: Path,
    target: Path,
    bits: int,
    group: int | None,
    symmetric: bool,
    act_order: bool = False,
) -> dict[str, torch.Tensor]:
    """pack-quantized: weight_packed [N, K / f] (unsigned: value + 2^(bits-1)), weight_scale
    [N, G], weight_zero_point [N / f, G] (asymmetric), weight_shape, weight_g_idx (actorder);
    group None: per channel."""
    state = load_file(source / "model.safetensors")
    expected = {}
    for name in linear_weights(state):
        w = state.pop(name)
        n, k = w.shape
        size = group or k
        groups = _group_index(k, size, act_order, seed=_input_of(name))
        codes, scales, zeros = rtn(w, bits, groups, k // size, symmetric)
        prefix = name.removesuffix(".weight")
        state[f"{prefix}.weight_packed"] = pack(codes, bits, dim=1)
        state[f"{prefix}.weight_scale"] = scales.half().contiguous()
        state[f"{prefix}.weight_shape"] = torch.tensor([n, k])
        if not symmetric:
            state[f"{prefix}.weight_zero_point"] = pack(zeros, bits, dim=0)
        if act_order:
            state[f"{prefix}.weight_g_idx"] = groups.to(torch.int32)
        expected[name] = dequantized(codes, scales, zeros, groups)
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric,
               "strategy": "group" if group else "channel", "group_size": group,
               "actorder": "group" if act_order else None, "dynamic": False}  # fmt: skip
    _write(source, target, state, _compressed_config("pack-quantized", weights, None))
    return expected


def _compressed_config(fmt: str, weights: dict, inputs: dict | None) -> dict:
    return {
        "quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": inputs, "output_activations": None}},
        "quantization_status": "compressed",
    }  # fmt: skip


def _fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)


def write_compressed_fp8(source: Path, target: Path) -> dict[str, torch.Tensor]:
    """float-quantized, channel strategy: weight fp8 [N, K], weight_scale [N, 1]; dynamic
    per-token activations."""
    state = load_file(source / "model.safetensors")
    expected = {}
    for name in linear_weights(state):
        w = state.pop(name)
        scale = (w.float().abs().amax(1, keepdim=True) / 448).clamp(min=1e-8)
        state[name] = _fp8(w, scale)
        state[name.replace(".weight", ".weight_scale")] = scale
        expected[name] = state[name].float() * scale
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
    inputs = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
              "dynamic": True}  # fmt: skip
    _write(source, target, state, _compressed_config("float-quantized", weights, inputs))
    return expected


def write_vllm_fp8(source: Path, target: Path, kv_scales: tuple[float, float] | None = None,
                   static: bool = True) -> dict[str, torch.Tensor]:  # fmt: skip
    """vLLM's fp8: weight fp8 [N, K], weight_scale one float32 a tensor, and input_scale
    (static activations; static False: dynamic, none); kv_scales: self_attn.k_scale / v_scale
    of every layer."""
    state = load_file(source / "model.safetensors")
    expected = {}
    for name in linear_weights(state):
        w = state.pop(name)
        scale = (w.float().abs().amax() / 448).clamp(min=1e-8)
        state[name] = _fp8(w, scale)
        state[name.replace(".weight", ".weight_scale")] = scale.reshape(())
        if static:
            state[name.replace(".weight", ".input_scale")] = torch.tensor(0.05)
        expected[name] = state[name].float() * scale
        if kv_scales is not None and name.endswith("self_attn.q_proj.weight"):
            attention = name.removesuffix(".q_proj.weight")
            state[f"{attention}.k_scale"] = torch.tensor(kv_scales[0])
            state[f"{attention}.v_scale"] = torch.tensor(kv_scales[1])
    scheme = "static" if static else "dynamic"
    _write(source, target, state, {"quant_method": "fp8", "activation_scheme": scheme})
    return expected


def write_block_fp8(source: Path, target: Path, block: tuple[int, int] = (32, 32)
                    ) -> dict[str, torch.Tensor]:  # fmt: skip
    """Block-wise FP8 as Qwen's and DeepSeek's FP8 releases store it: weight fp8 [N, K] and
    weight_scale_inv [N / bn, K / bk] float32, W = q * scale of q's block; quantization_config
    weight_block_size [bn, bk], dynamic activations."""
    state = load_file(source / "model.safetensors")
    expected = {}
    bn, bk = block
    for name in linear_weights(state):
        w = state.pop(name).float()
        n, k = w.shape
        blocks = w.reshape(n // bn, bn, k // bk, bk)
        scale = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-8)  # [N / bn, K / bk]
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        state[name] = _fp8(w, full)
        state[name.replace(".weight", ".weight_scale_inv")] = scale
        expected[name] = state[name].float() * full
    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
               "weight_block_size": list(block)}  # fmt: skip
    _write(source, target, state, qconfig)
    return expected


def write_float(source: Path, target: Path, weights: dict[str, torch.Tensor]) -> None:
    """The float model with these weights replaced (a dequantized checkpoint's twin)."""
    state = load_file(source / "model.safetensors")
    state.update({name: w.to(state[name].dtype) for name, w in weights.items()})
    shutil.copytree(source, target)
    save_file(state, target / "model.safetensors")


Writer = Callable[[Path, Path], dict[str, torch.Tensor]]


def memoized_writer(
    source: Path, writers: dict[str, Writer], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[Path, dict[str, torch.Tensor]]]:
    """checkpoint(format) -> (its directory, the dequantized weight of each tensor name), each
    format written from `source` once (a module fixture's body)."""
    made: dict[str, tuple[Path, dict[str, torch.Tensor]]] = {}

    def checkpoint(name: str) -> tuple[Path, dict[str, torch.Tensor]]:
        if name not in made:
            target = tmp_path_factory.mktemp(name) / "model"
            made[name] = (target, writers[name](source, target))
        return made[name]

    return checkpoint
