"""How a preempted request leaves: swapped to host memory or freed for recompute, whichever
the measured speeds say is cheaper (``SchedulerConfig.preemption_mode="auto"``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PreemptionCostModel:
    """Picks swap or recompute for one victim from measured speeds.

    Swap moves the victim's blocks out and back (2x its bytes over host bandwidth);
    recompute prefills its computed tokens again. The engine refreshes the speeds.
    """

    bytes_per_block: int = 1
    host_bandwidth: float = 10e9        # bytes/s between device and host memory
    prefill_tokens_per_s: float = 1e3   # tokens/s of prefill

    def prefer_swap(self, num_blocks: int, num_tokens: int) -> bool:
        swap_seconds = 2 * num_blocks * self.bytes_per_block / self.host_bandwidth
        return swap_seconds < num_tokens / self.prefill_tokens_per_s
