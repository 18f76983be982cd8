"""The LoRA adapters the HTTP server serves by name (a request's `model`): those of
--lora-modules, and those loaded and unloaded while it runs (vLLM's POST /v1/load_lora_adapter
and /v1/unload_lora_adapter, with --allow-runtime-lora-updating).

The API server owns the table. Each adapter gets an id (`LoRARequest.lora_int_id`) never given
to another within the run: the workers cache adapters by (id, path), so an adapter loaded again
from a rewritten directory is a new one to them. Unloading only removes the name; requests
already running with the adapter finish with it. The table (and the next id) is written to the
run directory on every change, whole or not at all, and a restarted API server reads it back:
adapters loaded at runtime survive the restart of the API server, not the engine's.
"""

from __future__ import annotations

import os
from typing import Annotated

import anyio
import msgspec

from pagedserve.actors.messages import LoRARequest
from pagedserve.api.errors import APIError
from pagedserve.config import EngineConfig
from pagedserve.models.lora_format import check_adapter
from pagedserve.models.model_config import load_model_config

STATE_FILE = "lora_adapters.json"  # in the run directory
MAX_NAME_CHARS = 256
MAX_PATH_CHARS = 4096  # Linux's PATH_MAX


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's body: `load_inplace` replaces an adapter of the same name (with a new id)."""

    lora_name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]
    lora_path: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PATH_CHARS)]
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's body: the adapter's name, its id, or both (then they must agree)."""

    lora_name: str | None = None
    lora_int_id: int | None = None


class AdapterTable(msgspec.Struct):
    """The served adapters in the order they came, and the id the next one gets."""

    adapters: list[LoRARequest]
    next_id: int


class LoRAAdapters:
    """The served adapters by name. `state_dir`: where the table survives a restart of the API
    server (the run directory; None: nowhere)."""

    def __init__(self, config: EngineConfig, model_name: str, state_dir: str | None) -> None:
        assert config.server is not None
        self.enabled, self.max_rank = config.enable_lora, config.max_lora_rank
        self.runtime_updating = config.server.allow_runtime_lora_updating
        self.model_name, self.limit = model_name, config.server.max_lora_adapters
        self.model = load_model_config(config.model_path, config.hf_overrides)
        self.state_path = None if state_dir is None else os.path.join(state_dir, STATE_FILE)
        table = self.read_state() or initial_table(config.server.lora_modules)
        self.by_name = {lora.lora_name: lora for lora in table.adapters}
        self.next_id = table.next_id
        self.lock = anyio.Lock()  # one change at a time: a load checks the adapter in a thread

    def get(self, name: str) -> LoRARequest | None:
        return self.by_name.get(name)

    def served(self) -> list[LoRARequest]:
        return list(self.by_name.values())

    def require_runtime_updating(self) -> None:
        if not self.enabled:
            raise APIError("LoRA adapters need a server started with --enable-lora", 400)
        if not self.runtime_updating:
            raise APIError(
                "loading and unloading LoRA adapters needs a server started with "
                "--allow-runtime-lora-updating",
                400,
            )

    async def load(self, body: LoadLoRAAdapterRequest) -> None:
        """Serve the adapter at `body.lora_path` as `body.lora_name`; APIError 400 when the
        name is taken (or the model's), the table is full, or the adapter does not fit."""
        name = body.lora_name
        if name == self.model_name:
            raise APIError(f"'{name}' is the served model's name", 400)
        async with self.lock:
            if name in self.by_name and not body.load_inplace:
                raise APIError(f"The lora adapter '{name}' has already been loaded.", 400)
            if name not in self.by_name and len(self.by_name) >= self.limit:
                raise APIError(f"at most {self.limit} LoRA adapters are served at once", 400)
            await anyio.to_thread.run_sync(self.check, body.lora_path)
            lora = LoRARequest(name, self.next_id, body.lora_path)
            self.commit({**self.by_name, name: lora}, self.next_id + 1)

    async def unload(self, body: UnloadLoRAAdapterRequest) -> LoRARequest:
        """Stop serving the adapter `body` names; APIError 404 when none is served."""
        if body.lora_name is None and body.lora_int_id is None:
            raise APIError("give the adapter's lora_name or lora_int_id", 400)
        async with self.lock:
            gone = self.find(body.lora_name, body.lora_int_id)
            kept = {name: lora for name, lora in self.by_name.items() if lora is not gone}
            self.commit(kept, self.next_id)
        return gone

    def find(self, name: str | None, lora_int_id: int | None) -> LoRARequest:
        for lora in self.by_name.values():
            if name in (None, lora.lora_name) and lora_int_id in (None, lora.lora_int_id):
                return lora
        label = f"'{name}'" if name is not None else f"with lora_int_id {lora_int_id}"
        raise APIError(f"The lora adapter {label} cannot be found.", 404)

    def check(self, path: str) -> None:
        """The checks of --lora-modules at start (torch-free: config and safetensors header)."""
        try:
            check_adapter(path, self.model, self.max_rank)
        except ValueError as exc:
            raise APIError(str(exc), 400) from None

    def commit(self, by_name: dict[str, LoRARequest], next_id: int) -> None:
        """Write the new table, then serve it (no await between: a change is whole)."""
        if self.state_path is not None:
            table = AdapterTable(list(by_name.values()), next_id)
            write_whole(self.state_path, msgspec.json.encode(table))
        self.by_name, self.next_id = by_name, next_id

    def read_state(self) -> AdapterTable | None:
        """The table an earlier incarnation of the API server left; None at the run's start."""
        if self.state_path is None or not os.path.exists(self.state_path):
            return None
        with open(self.state_path, "rb") as f:
            return msgspec.json.decode(f.read(), type=AdapterTable)


def initial_table(modules: dict[str, str]) -> AdapterTable:
    """--lora-modules' adapters, with ids 1, 2, ... in their order."""
    adapters = [LoRARequest(name, i, path) for i, (name, path) in enumerate(modules.items(), 1)]
    return AdapterTable(adapters, len(adapters) + 1)


def write_whole(path: str, data: bytes) -> None:
    partial = f"{path}.{os.getpid()}"
    with open(partial, "wb") as f:
        f.write(data)
    os.replace(partial, path)
