"""The engine's LoRA adapters: loaded from PEFT files on first use, kept in host memory
(least recently used dropped beyond ``max_cpu_loras``), seated on the device by the
scheduler (``core.sched.lora_slots``) and written there just before the call that needs them.

A request's adapter joins its block hashes (``Request.extra_keys``), so the same prompt
under two adapters, or under an adapter and the base model, never shares prefix-cache
blocks. The key is unique per load: an adapter removed and loaded again (perhaps from
new files) never matches blocks computed with the old weights.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from typing import Any

from jaxpage.arch_config import ArchConfig
from jaxpage.core.sched.lora_slots import LoRASlots
from jaxpage.core.request import Request
from jaxpage.lora_request import LoRARequest
from jaxpage.models.lora import attach_lora
from jaxpage.models.peft_adapter import LoRAWeights, load_peft_adapter
from jaxpage.models.registry import resolve_architecture

_serials = itertools.count(1)


@dataclass(eq=False)
class LoadedLoRA:
    """An adapter in host memory; ``key`` is unique to this load."""

    request: LoRARequest
    weights: LoRAWeights
    key: tuple = field(default_factory=lambda: ("lora", next(_serials)))

    @property
    def name(self) -> str:
        return self.request.lora_name


class LoRAManager:
    """Adapters by name, for one engine (thread-safe: the server loads off the loop)."""

    def __init__(self, arch: ArchConfig, *, max_loras: int, max_rank: int,
                 max_cpu_loras: int | None) -> None:
        self.arch = arch
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self._loaded: OrderedDict[str, LoadedLoRA] = OrderedDict()  # LRU first
        self._lock = threading.Lock()

    def get(self, lora_request: LoRARequest) -> LoadedLoRA:
        """The loaded adapter of ``lora_request`` (loading its files if needed).

        ValueError: files that are not an adapter of this model, a rank above
        ``max_lora_rank``, or a name already loaded with another id or path."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request={lora_request!r} must be a LoRARequest")
        with self._lock:
            loaded = self._loaded.get(lora_request.lora_name)
            if loaded is not None:
                self._check_same(loaded.request, lora_request)
                self._loaded.move_to_end(lora_request.lora_name)
                return loaded
            for other in self._loaded.values():
                if other.request.lora_int_id == lora_request.lora_int_id:
                    raise ValueError(f"lora_int_id={lora_request.lora_int_id} is already used "
                                     f"by adapter {other.name!r}")
        if not lora_request.lora_path:
            raise ValueError(f"adapter {lora_request.lora_name!r} is not loaded and its "
                             "lora_path is empty")
        weights = load_peft_adapter(lora_request.lora_path, self.arch, self.max_rank)
        with self._lock:
            loaded = self._loaded.get(lora_request.lora_name)
            if loaded is not None:  # another thread loaded that name meanwhile
                self._check_same(loaded.request, lora_request)
                return loaded
            loaded = LoadedLoRA(lora_request, weights)
            self._loaded[lora_request.lora_name] = loaded
            self._trim()
            return loaded

    def remove(self, name: str) -> LoadedLoRA | None:
        """Forget adapter ``name`` (requests already using it finish with it)."""
        with self._lock:
            return self._loaded.pop(name, None)

    def list(self) -> list[LoRARequest]:
        with self._lock:
            return [loaded.request for loaded in self._loaded.values()]

    def _trim(self) -> None:
        if self.max_cpu_loras is None:
            return
        while len(self._loaded) > self.max_cpu_loras:
            # the requests holding it keep its weights alive; a later request reloads it
            self._loaded.popitem(last=False)

    @staticmethod
    def _check_same(loaded: LoRARequest, asked: LoRARequest) -> None:
        if asked.lora_int_id != loaded.lora_int_id or (
                asked.lora_path and asked.lora_path != loaded.lora_path):
            raise ValueError(f"adapter {asked.lora_name!r} is loaded as lora_int_id="
                             f"{loaded.lora_int_id} from {loaded.lora_path!r}, not as "
                             f"lora_int_id={asked.lora_int_id} from {asked.lora_path!r}; "
                             "remove it first to load another under that name")


class LoRAAdapters:
    """``LLMEngine``'s LoRA surface (mixed into it): ``add_lora`` / ``remove_lora`` / ``list_loras`` and the set-up. Uses the engine's
    ``config``, ``loras`` (a ``LoRAManager``, None when LoRA is off) and ``scheduler``."""

    def _enable_lora(self, loaded: Any, mesh: Any) -> LoRAManager:
        """Give the model its adapter slots; the manager of adapters by name."""
        mc, parallel = self.config.model, self.config.parallel
        if parallel.num_processes > 1 or parallel.data_parallel_size > 1:
            raise ValueError("enable_lora=True is not supported with num_processes > 1 or "
                             "data_parallel_size > 1 (tensor_parallel_size is)")
        if self.config.cache.kv_role is not None:
            raise ValueError("enable_lora=True is not supported with disaggregated serving "
                             f"(kv_role={self.config.cache.kv_role!r})")
        attach_lora(loaded.model, mc.max_loras, mc.max_lora_rank, mesh)
        return LoRAManager(resolve_architecture(loaded.hf_config)[1], max_loras=mc.max_loras,
                           max_rank=mc.max_lora_rank, max_cpu_loras=mc.max_cpu_loras)

    def _lora_slots(self) -> LoRASlots | None:
        return None if self.loras is None else LoRASlots(self.config.model.max_loras)

    def _adapter(self, lora_request: LoRARequest | None) -> LoadedLoRA | None:
        if lora_request is None:
            return None
        if self.loras is None:
            raise ValueError(f"lora_request={lora_request!r} needs an engine started with "
                             "enable_lora=True")
        return self.loras.get(lora_request)

    @staticmethod
    def _run_with_adapter(request: Request, adapter: LoadedLoRA | None) -> None:
        """Put ``adapter`` on the request and its siblings; its key joins their block
        hashes (no prefix-cache block is shared across adapters)."""
        if adapter is None:
            return
        for sequence in (request, *request.fork_children):
            sequence.lora = adapter
            sequence.extra_keys = sequence.extra_keys + (adapter.key,)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into host memory now (requests naming it later skip the files).
        True when it was loaded by this call, False if it already was."""
        if self.loras is None:
            raise ValueError("add_lora needs an engine started with enable_lora=True")
        known = lora_request.lora_name in {r.lora_name for r in self.loras.list()}
        self.loras.get(lora_request)
        return not known

    def remove_lora(self, lora_name: str) -> bool:
        """Unload adapter ``lora_name``: requests running with it finish with it; its
        device slot is freed once none does. False when no such adapter is loaded."""
        if self.loras is None:
            return False
        removed = self.loras.remove(lora_name)
        if removed is None:
            return False
        self.scheduler.lora.slots.forget(removed.key, self.scheduler.adapters_in_use())
        return True

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded in host memory, least recently used first."""
        return [] if self.loras is None else self.loras.list()
