"""The adapters a server offers as models, and vLLM's routes that load and unload them.

A client picks an adapter by sending its name as ``model``; ``--lora-modules name=path``
registers adapters at start-up, ``POST /v1/load_lora_adapter`` (``{"lora_name",
"lora_path"}``) and ``POST /v1/unload_lora_adapter`` (``{"lora_name"}``) while serving.
``GET /v1/models`` lists each adapter with the base model as its ``parent``.
"""

from __future__ import annotations

import asyncio
import itertools
import threading

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from jaxpage.lora_request import LoRARequest
from jaxpage.server.errors import APIError, bad_request_from


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


class ServedAdapters:
    """Adapter name -> LoRARequest, for one server (ids handed out in order)."""

    def __init__(self, engine, base_name: str) -> None:
        self.engine = engine  # the AsyncLLMEngine
        self.base_name = base_name
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._loading: set[str] = set()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.engine.engine.loras is not None

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def names(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    def add(self, name: str, path: str) -> LoRARequest:
        """Load adapter ``name`` from ``path`` (its files are read now); ValueError for a
        name in use, or files that are not an adapter of this model."""
        if not self.enabled:
            raise ValueError("LoRA adapters need a server started with --enable-lora true "
                             "(or --lora-modules)")
        if not name or name == self.base_name:
            raise ValueError(f"lora_name={name!r} must be non-empty and differ from the "
                             f"base model's name {self.base_name!r}")
        with self._lock:
            if name in self._by_name or name in self._loading:
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
            self._loading.add(name)  # reserved while its files are read
            request = LoRARequest(name, next(self._ids), path)
        try:
            # A request that resolved the name before an unload may have loaded it into
            # the engine again since: that copy is stale, this load replaces it.
            self.engine.engine.loras.remove(name)
            self.engine.engine.add_lora(request)
            with self._lock:
                self._by_name[name] = request
        finally:
            with self._lock:
                self._loading.discard(name)
        return request

    def remove(self, name: str) -> bool:
        """Unload ``name`` (runs on the engine thread: it frees the adapter's slot)."""
        with self._lock:
            request = self._by_name.pop(name, None)
        if request is None:
            return False
        self.engine.engine.remove_lora(name)
        return True


def add_lora_routes(app: FastAPI, adapters: ServedAdapters, errors: dict) -> None:
    """``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's routes)."""

    @app.post("/v1/load_lora_adapter", responses=errors)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        loop = asyncio.get_running_loop()
        try:  # reading the files happens off the event loop
            await loop.run_in_executor(None, adapters.add, body.lora_name, body.lora_path)
        except ValueError as error:
            raise bad_request_from(error) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", responses=errors)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        if not adapters.enabled:
            raise APIError(400, "LoRA adapters need a server started with --enable-lora true",
                           param="lora_name")
        removed = await adapters.engine.run(lambda: adapters.remove(body.lora_name))
        if not removed:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.",
                           param="lora_name", code="model_not_found")
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
