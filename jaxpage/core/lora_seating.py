"""The scheduler's part for LoRA adapters: which waiting request may join the running set
given the device's adapter slots (``core.lora_slots``), and seating it.

Invariant kept: the adapters of running requests number at most ``max_loras``, so a
running request's adapter is never evicted and its slot never changes while it runs.
A request whose adapter cannot be seated now is passed over, but not for ever (see
``_best_seatable``); a swapped-out one holds new admissions back (``Scheduler._swap_in``).
"""

from __future__ import annotations

from jaxpage.core.lora_slots import LoRASlots
from jaxpage.core.request import Request


class LoRASeating:
    """Mixed into ``Scheduler``; uses its ``lora_slots`` (None: LoRA off), ``running``,
    ``waiting``, ``config``, ``step_count`` and ``_priority_key``."""

    lora_slots: LoRASlots | None

    def _best_seatable(self, adapters: set) -> Request | None:
        """The waiting request to admit next among those whose adapter can be seated
        now; None once one passed over has waited ``priority_aging_steps`` steps."""
        patience = self.config.priority_aging_steps
        fcfs = self.config.scheduling_policy == "fcfs"
        best = None
        for request in self.waiting:  # FCFS: usually the head fits, O(1)
            if self._may_seat(request, adapters):
                if fcfs:
                    return request
                if best is None or self._priority_key(request) < self._priority_key(best):
                    best = request
            elif self.step_count - request.added_step > patience:
                return None  # it has been passed over long enough
        return best

    def adapters_in_use(self) -> set | None:
        """Keys of the adapters running requests use; None when LoRA is off."""
        if self.lora_slots is None:
            return None
        return {r.lora.key for r in self.running if r.lora is not None}

    def _may_seat(self, request: Request, adapters: set) -> bool:
        return request.lora is None or self.lora_slots.can_seat(request.lora.key, adapters)

    def _seat(self, request: Request, adapters: set | None) -> None:
        """Give a request joining the running set its adapter's slot (and its unborn
        siblings, which run with it)."""
        if adapters is None or request.lora is None:
            return
        slot = self.lora_slots.acquire(request.lora.key, request.lora, adapters)
        adapters.add(request.lora.key)
        for member in (request, *request.fork_children):
            member.lora_slot = slot

    def _lora_stats(self) -> dict[str, int | str]:
        """Adapters of running and waiting requests (names, comma-separated, sorted)."""
        def names(requests) -> str:
            return ",".join(sorted({getattr(r.lora, "name", str(r.lora.key))
                                    for r in requests if r.lora is not None}))
        return {"max_lora": self.lora_slots.max_loras, "lora_running": names(self.running),
                "lora_waiting": names(self.waiting), "lora_slot_loads": self.lora_slots.num_loads}
