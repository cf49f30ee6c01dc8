"""The device's LoRA adapter slots, assigned least recently used first.

The device holds ``max_loras`` adapters at once, in slots 1..max_loras (0 means the base
model: ``jaxpage.models.lora``). The scheduler seats an adapter when a request using it
joins the running set (``acquire``); an adapter not resident is written into a free
slot, or into the slot of the least recently used adapter that no running request uses.
The writes wait in ``take_loads`` for the engine to run before the next device call.

Invariant kept with the scheduler: the adapters of running requests number at most
``max_loras`` (the scheduler admits a request whose adapter is not seated only while
fewer are in use), so a running request's adapter is never evicted and its slot is the
same for as long as it runs. Adapters are keyed by a value unique per load (an adapter
unloaded and loaded again is a new key), so a slot never serves stale weights.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Hashable


class LoRASlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slot_of: OrderedDict[Hashable, int] = OrderedDict()  # key -> slot, LRU first
        self._adapter_of: dict[Hashable, Any] = {}  # key -> adapter, for resident keys
        self._free = list(range(max_loras, 0, -1))  # pop() gives the lowest free slot
        self._loads: list[tuple[int, Any]] = []
        self.num_loads = 0

    def slot_of(self, key: Hashable) -> int | None:
        """The slot holding adapter ``key``, or None."""
        return self._slot_of.get(key)

    def can_seat(self, key: Hashable, in_use: set) -> bool:
        """Whether ``acquire(key, ..., in_use)`` would find a slot."""
        return key in in_use or key in self._slot_of or len(in_use) < self.max_loras

    def acquire(self, key: Hashable, adapter: Any, in_use: set) -> int:
        """The slot of adapter ``key`` (marked most recently used), loading ``adapter``
        into one when it is not resident. ``in_use``: keys of the adapters running
        requests use, never evicted. ValueError when no slot can be had (see
        ``can_seat``)."""
        slot = self._slot_of.get(key)
        if slot is not None:
            self._slot_of.move_to_end(key)
            return slot
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((k for k in self._slot_of if k not in in_use), None)
            if victim is None:
                raise ValueError(f"no LoRA slot is free: all {self.max_loras} hold adapters "
                                 "of running requests")
            slot = self._slot_of.pop(victim)
            del self._adapter_of[victim]
        self._slot_of[key] = slot
        self._adapter_of[key] = adapter
        self._loads.append((slot, adapter))
        self.num_loads += 1
        return slot

    def forget(self, key: Hashable, in_use: set) -> None:
        """Drop adapter ``key`` (unloaded) from its slot unless a running request uses it;
        its slot becomes free. A key in use stays until evicted later."""
        if key in self._slot_of and key not in in_use:
            self._free.append(self._slot_of.pop(key))
            del self._adapter_of[key]
            self._free.sort(reverse=True)

    def take_loads(self) -> list[tuple[int, Any]]:
        """(slot, adapter) writes due before the next device call, in order; cleared."""
        loads, self._loads = self._loads, []
        return loads

    def holder(self, slot: int) -> Any:
        """The adapter assigned to ``slot`` (None: free)."""
        return next((self._adapter_of[k] for k, s in self._slot_of.items() if s == slot), None)

    def resident(self) -> dict[Hashable, int]:
        """Adapter key -> slot, least recently used first."""
        return dict(self._slot_of)
