"""A worker's LoRA adapters (models/lora.py): which adapter each slot holds, which slot each
row of the persistent batch runs with, and a step's tokens grouped by slot.

The scheduler never runs more than max_loras adapters at once (admission.py), and a request
leaves the worker's batch when it finishes or is preempted, so an adapter a new request needs
either holds a slot already or finds one that no row uses (the least recently loaded such).
Loading writes the slot's weights on the device's stream, after any step still reading them.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from pagedserve.actors.messages import LoRARequest
from pagedserve.actors.worker.speculative import decode_rows
from pagedserve.actors.worker.uploader import Uploader
from pagedserve.config import EngineConfig
from pagedserve.models.lora import attach_lora, kernel_rank, load_adapter, tokens_by_slot
from pagedserve.models.lora_format import read_adapter_config


class LoRASlots:
    def __init__(self, model: nn.Module, config: EngineConfig, device: torch.device) -> None:
        rank = kernel_rank(config.max_lora_rank)
        self.layers, self.context = attach_lora(model, config.max_loras, rank, model.layer_config)
        self.device = device
        self.slot_of: OrderedDict[tuple[int, str], int] = OrderedDict()  # adapter -> slot
        self.num_slots = config.max_loras
        self.free = list(range(config.max_loras))
        self.row_slot = np.full(config.max_num_seqs, -1, np.int64)
        self.step_adapted = False  # whether any token of the step `prepare` saw has an adapter
        self.uploader: Uploader | None = None
        if device.type == "cuda":  # the kernels' path for every step, CUDA graphs included
            self.use_kernels(max(decode_rows(config), config.max_num_batched_tokens))

    def use_kernels(self, rows: int) -> None:
        """Steps of at most `rows` tokens take the kernels, which read the tokens sorted by
        slot from a device buffer (the graphs captured at start-up take them too)."""
        buffer = torch.zeros(rows + self.num_slots + 1, dtype=torch.int32, device=self.device)
        self.context.order, self.context.starts = buffer[:rows], buffer[rows:]
        self.context.use_kernel = True
        self.buffer_adapted = False  # whether the buffer holds any token with an adapter
        self.uploader = Uploader(self.device)  # its own: the step's uploader's buffer is in use

    def assign(self, row: int, lora: LoRARequest | None, live_rows: list[int]) -> None:
        """Row `row` (a new request) runs with `lora`: load it if no slot holds it."""
        self.row_slot[row] = -1  # not its previous request's any more
        if lora is None:
            return
        key = (lora.lora_int_id, lora.lora_path)
        if key not in self.slot_of:
            slot = self._take_slot(set(self.row_slot[live_rows].tolist()))
            load_adapter(self.layers, slot, lora.lora_path, read_adapter_config(lora.lora_path))
            self.slot_of[key] = slot
        self.slot_of.move_to_end(key)
        self.row_slot[row] = self.slot_of[key]

    def _take_slot(self, in_use: set[int]) -> int:
        if self.free:
            return self.free.pop()
        for key, slot in self.slot_of.items():  # the least recently used first
            if slot not in in_use:
                del self.slot_of[key]
                return slot
        raise RuntimeError("every LoRA slot is in use: more adapters than max_loras at once")

    def prepare(self, rows: np.ndarray, num_tokens: list[int]) -> None:
        """The step's tokens (rows' tokens one row after another) by slot: sorted by slot in
        the kernels' buffer (GPU, a step that fits it), else grouped."""
        slots = np.repeat(self.row_slot[rows], num_tokens)
        context = self.context
        order = context.order
        context.use_kernel = order is not None and len(slots) <= len(order)
        adapted = self.step_adapted = bool((slots >= 0).any())
        if context.use_kernel:
            assert order is not None and context.starts is not None
            context.groups = []
            if adapted or self.buffer_adapted:  # else the buffer says "no token" already
                self._upload_order(slots, order, context.starts)
                self.buffer_adapted = adapted
            return
        context.groups = [
            (int(slot), torch.from_numpy(np.flatnonzero(slots == slot)).to(self.device))
            for slot in np.unique(slots[slots >= 0])
        ]

    @contextlib.contextmanager
    def without_adapters(self) -> Iterator[None]:
        """The layers add no delta and launch no LoRA kernel inside this block (the decode
        graphs' variant for steps without an adapter: cuda_graphs.DecodeStep)."""
        context = self.context
        saved = context.use_kernel, context.groups
        context.use_kernel, context.groups = False, []
        try:
            yield
        finally:
            context.use_kernel, context.groups = saved

    def _upload_order(self, slots: np.ndarray, order: torch.Tensor, starts: torch.Tensor) -> None:
        """The step's tokens sorted by slot into the buffer (ordered after the last step): its
        first len(slots) entries and the starts; the kernels read no entry past them."""
        assert self.uploader is not None
        n = len(slots)
        host = self.uploader.upload([tokens_by_slot(slots, self.num_slots, n)])[0]
        order[:n].copy_(host[:n])
        starts.copy_(host[n:])
