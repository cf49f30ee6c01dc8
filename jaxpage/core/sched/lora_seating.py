"""The scheduler's part for LoRA adapters: which waiting request may join the running set
given the device's adapter slots (``core.sched.lora_slots``), and seating it.

Invariant kept: the adapters of running requests number at most ``max_loras``, so a
running request's adapter is never evicted and its slot never changes while it runs.
A request whose adapter cannot be seated now is passed over, but not for ever (see
``best_seatable``); a swapped-out one holds new admissions back (``Scheduler._swap_in``).
"""

from __future__ import annotations

from typing import Callable, Iterable

from jaxpage.config import SchedulerConfig
from jaxpage.core.request import Request
from jaxpage.core.sched.lora_slots import LoRASlots


class LoRASeating:
    """Owns the device's adapter slots (``slots``) on the scheduler's behalf."""

    def __init__(self, config: SchedulerConfig, slots: LoRASlots) -> None:
        self.config = config
        self.slots = slots

    def best_seatable(self, waiting: Iterable[Request], adapters: set, step_count: int,
                      priority_key: Callable[[Request], tuple]) -> Request | None:
        """The waiting request to admit next among those whose adapter can be seated
        now; None once one passed over has waited ``priority_aging_steps`` steps."""
        patience = self.config.priority_aging_steps
        fcfs = self.config.scheduling_policy == "fcfs"
        best = None
        for request in waiting:  # FCFS: usually the head fits, O(1)
            if self.may_seat(request, adapters):
                if fcfs:
                    return request
                if best is None or priority_key(request) < priority_key(best):
                    best = request
            elif step_count - request.added_step > patience:
                return None  # it has been passed over long enough
        return best

    @staticmethod
    def adapters_in_use(running: Iterable[Request]) -> set:
        """Keys of the adapters ``running`` requests use."""
        return {r.lora.key for r in running if r.lora is not None}

    def may_seat(self, request: Request, adapters: set) -> bool:
        return request.lora is None or self.slots.can_seat(request.lora.key, adapters)

    def seat(self, request: Request, adapters: set) -> None:
        """Give a request joining the running set its adapter's slot (and its unborn
        siblings, which run with it)."""
        if request.lora is None:
            return
        slot = self.slots.acquire(request.lora.key, request.lora, adapters)
        adapters.add(request.lora.key)
        for member in (request, *request.fork_children):
            member.lora_slot = slot

    def stats(self, running: Iterable[Request], waiting: Iterable[Request]) -> dict[str, int | str]:
        """Adapters of running and waiting requests (names, comma-separated, sorted)."""
        def names(requests) -> str:
            return ",".join(sorted({getattr(r.lora, "name", str(r.lora.key))
                                    for r in requests if r.lora is not None}))
        return {"max_lora": self.slots.max_loras, "lora_running": names(running),
                "lora_waiting": names(waiting), "lora_slot_loads": self.slots.num_loads}
