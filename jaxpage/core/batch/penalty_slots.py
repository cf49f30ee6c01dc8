"""Which row of the device's penalty table each request with penalties owns.

Presence, frequency and repetition penalties need, per sequence, which tokens it has seen
(prompt and output) and how often each appeared in its output. The device keeps that in
one table, int32 [num_slots, vocab], updated by every step that samples a token: so a
penalized batch has the same shapes as any other (no program of its own to compile) and
multi-step calls can chain without the host's help.

This host-side map hands out the rows:

* a request gets a slot the first time a batch samples a token for it; the slot is then
  filled from the host's copy of its tokens (a *fill*, run on the device before that
  batch), and from then on the device alone keeps it current;
* slots are taken back lazily: a request that finished, or, when every slot is taken,
  the one used longest ago among requests outside the batch being built (it is filled
  again from the host when it returns).

Invariant: a fill copies the host's tokens, so one may only be made when the host knows
every token the device sampled (no call in flight). ``assign`` with ``ahead=True`` (a
chained call) never makes a fill; every request in it must already own its slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# A table value is count_in_output | SEEN: SEEN marks a token of the prompt or the output.
SEEN = 1 << 30


@dataclass(frozen=True)
class PenaltyFill:
    """Overwrite row ``slot`` with ``values`` at ``token_ids`` (zeros elsewhere)."""

    slot: int
    token_ids: np.ndarray  # int32 [D] distinct tokens of the prompt and the output
    values: np.ndarray     # int32 [D] count in the output | SEEN


def penalty_fill(slot: int, request) -> PenaltyFill:
    """The row of ``request`` as the host knows it."""
    ids = np.unique(np.asarray(request.all_token_ids, np.int32))
    out_ids, out_counts = np.unique(np.asarray(request.output_token_ids, np.int32),
                                    return_counts=True)
    values = np.full(len(ids), SEEN, np.int32)
    values[np.searchsorted(ids, out_ids)] |= out_counts.astype(np.int32)
    return PenaltyFill(slot, ids, values)


class PenaltySlots:
    """Slot per request (by identity). ``num_slots`` must be >= the largest batch."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots} must be >= 1")
        self.num_slots = num_slots
        self._owner: list = [None] * num_slots     # the Request owning each slot
        self._last_used = np.zeros(num_slots, np.int64)
        self._slot_of: dict[int, int] = {}         # id(request) -> slot
        self._clock = 0
        self._fills: list[PenaltyFill] = []

    def slot_of(self, request) -> int | None:
        slot = self._slot_of.get(id(request))
        if slot is not None and self._owner[slot] is request:
            return slot
        return None

    def assign(self, requests: list, *, ahead: bool = False) -> np.ndarray:
        """Slots for the rows of a batch (int32 [len(requests)]); None entries get -1.

        New owners are queued for a fill (``take_fills``); see the module invariant.
        """
        self._clock += 1
        slots = np.full(len(requests), -1, np.int32)
        missing = []
        in_batch = set()
        for i, request in enumerate(requests):
            if request is None:
                continue
            slot = self.slot_of(request)
            if slot is None:
                missing.append(i)
                continue
            slots[i] = slot
            in_batch.add(slot)
            self._last_used[slot] = self._clock
        if missing and ahead:
            raise RuntimeError("a chained call has a penalized request without a penalty "
                               "slot; its row cannot be filled while a call is in flight")
        for i in missing:
            slot = self._free_slot(in_batch)
            old = self._owner[slot]
            if old is not None:
                self._slot_of.pop(id(old), None)
            self._owner[slot] = requests[i]
            self._slot_of[id(requests[i])] = slot
            self._last_used[slot] = self._clock
            in_batch.add(slot)
            slots[i] = slot
            self._fills.append(penalty_fill(slot, requests[i]))
        return slots

    def _free_slot(self, in_batch: set[int]) -> int:
        best, best_key = None, None
        for slot, owner in enumerate(self._owner):
            if slot in in_batch:
                continue
            if owner is None or owner.is_finished:
                return slot
            if best is None or self._last_used[slot] < best_key:
                best, best_key = slot, self._last_used[slot]
        if best is None:
            raise RuntimeError(f"a batch needs more than {self.num_slots} penalty slots")
        return best

    def forget(self, requests) -> None:
        """Give up the slots of ``requests`` (refilled from the host when they next need one):
        for a batch whose sampled tokens the device did not count."""
        freed = set()
        for request in requests:
            slot = self.slot_of(request)
            if slot is not None:
                self._owner[slot] = None
                del self._slot_of[id(request)]
                freed.add(slot)
        self._fills = [fill for fill in self._fills if fill.slot not in freed]

    def take_fills(self) -> list[PenaltyFill]:
        fills, self._fills = self._fills, []
        return fills
