"""LoRA adapter slots: LRU assignment with exact slot ids, and the scheduler's rule that
the adapters of running requests never outnumber the slots."""

from types import SimpleNamespace

import numpy as np

import pytest

from jaxpage.core.sched.lora_slots import LoRASlots
from jaxpage.core.request import RequestStatus
from jaxpage.core.sched.step_result import StepResult

from tests.core.helpers import make_request, make_scheduler


def test_slots_fill_lowest_first_then_evict_least_recently_used():
    slots = LoRASlots(2)
    assert slots.acquire("a", "A", set()) == 1
    assert slots.acquire("b", "B", set()) == 2
    assert slots.take_loads() == [(1, "A"), (2, "B")]
    assert slots.acquire("a", "A", set()) == 1          # resident: no load, now most recent
    assert slots.take_loads() == []
    assert slots.acquire("c", "C", set()) == 2          # b was least recently used
    assert slots.take_loads() == [(2, "C")]
    assert slots.resident() == {"a": 1, "c": 2}
    assert slots.num_loads == 3
    assert (slots.holder(1), slots.holder(2)) == ("A", "C")


def test_adapters_in_use_are_never_evicted():
    slots = LoRASlots(2)
    slots.acquire("a", "A", set())
    slots.acquire("b", "B", set())
    assert slots.acquire("c", "C", {"a"}) == 2          # a is older but running: b goes
    assert not slots.can_seat("d", {"a", "c"})
    with pytest.raises(ValueError, match="no LoRA slot is free"):
        slots.acquire("d", "D", {"a", "c"})
    assert slots.can_seat("a", {"a", "c"})


def test_forget_frees_the_slot_unless_in_use():
    slots = LoRASlots(3)
    for key in "abc":
        slots.acquire(key, key.upper(), set())
    slots.forget("b", {"b"})
    assert slots.slot_of("b") == 2                      # a running request still uses it
    slots.forget("b", set())
    assert slots.slot_of("b") is None
    slots.take_loads()
    assert slots.acquire("d", "D", {"a", "c"}) == 2      # the freed slot, nothing evicted
    assert slots.resident() == {"a": 1, "c": 3, "d": 2}


def _with_adapter(request, key):
    request.lora = SimpleNamespace(key=key)
    return request


def test_scheduler_runs_at_most_max_loras_adapters_and_passes_over_the_rest():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=8, lora_slots=LoRASlots(2))
    a1 = _with_adapter(make_request("a1", 5), "A")
    b1 = _with_adapter(make_request("b1", 5), "B")
    c1 = _with_adapter(make_request("c1", 5), "C")
    base = make_request("base", 5)
    a2 = _with_adapter(make_request("a2", 5), "A")
    for request in (a1, b1, c1, base, a2):
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert [item.request.request_id for item in out.scheduled] == ["a1", "b1", "base", "a2"]
    assert [r.lora_slot for r in (a1, b1, base, a2)] == [1, 2, 0, 1]
    assert c1.status is RequestStatus.WAITING and c1.lora_slot == 0
    assert scheduler.lora.slots.take_loads() == [(1, a1.lora), (2, b1.lora)]
    # b1 finishes: its adapter's slot is the one C takes, A's stays (a1, a2 run)
    scheduler.finish_request("b1", RequestStatus.FINISHED_ABORTED)
    scheduler.apply(out, StepResult(np.zeros(len(out.scheduled), np.int32)))
    scheduler.schedule()
    assert c1.status is RequestStatus.RUNNING and c1.lora_slot == 2
    assert scheduler.lora.slots.take_loads() == [(2, c1.lora)]
    assert scheduler.lora.slots.resident() == {"A": 1, "C": 2}


def test_with_one_slot_the_next_adapter_waits_for_the_running_one_to_finish():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=1, lora_slots=LoRASlots(1))
    a = _with_adapter(make_request("a", 5), "A")
    b = _with_adapter(make_request("b", 5), "B")
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    assert [item.request.request_id for item in out.scheduled] == ["a"]
    scheduler.apply(out, StepResult(np.zeros(1, np.int32)))
    assert scheduler.schedule().requests == [a]      # b waits: its adapter has no slot
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    scheduler.apply(out, StepResult(np.zeros(1, np.int32)))
    out = scheduler.schedule()
    assert [item.request.request_id for item in out.scheduled] == ["b"] and b.lora_slot == 1
    assert scheduler.lora.slots.take_loads() == [(1, a.lora), (1, b.lora)]


def test_a_request_passed_over_for_its_adapter_does_not_wait_for_ever():
    """With one slot held by adapter A, requests of A keep arriving; B's request is passed
    over only for ``priority_aging_steps`` steps, then nothing is admitted past it until
    A's requests drain and B gets the slot."""
    scheduler = make_scheduler(num_blocks=256, max_num_seqs=8, priority_aging_steps=3, lora_slots=LoRASlots(1))
    first = _with_adapter(make_request("a0", 5, max_tokens=3), "A")
    scheduler.add_request(first)
    blocked = _with_adapter(make_request("b", 5, max_tokens=3), "B")
    scheduler.add_request(blocked)
    admitted = []
    for step in range(12):
        scheduler.add_request(_with_adapter(make_request(f"a{step + 1}", 5, max_tokens=3), "A"))
        out = scheduler.schedule()
        admitted += [i.request.request_id for i in out.scheduled
                     if i.request.num_computed_tokens == 0]
        scheduler.apply(out, StepResult(np.full(len(out.scheduled), 7, np.int32)))
        if blocked.status is RequestStatus.RUNNING:
            break
    assert blocked.status is RequestStatus.RUNNING and blocked.lora_slot == 1
    # A's requests were admitted past it for 3 steps (the patience), then none until A's
    # running requests finished and B took the slot
    assert admitted == ["a0", "a1", "a2", "a3", "b"]


def test_a_swapped_request_waiting_for_its_adapter_holds_new_work_back():
    """A request swapped out while its adapter lost its slot comes back before new work:
    no waiting request is admitted until the swapped one gets a slot."""
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=8, num_host_blocks=16,
                               preemption_mode="swap", lora_slots=LoRASlots(2))
    a0 = _with_adapter(make_request("a0", 5, max_tokens=50), "A")
    b = _with_adapter(make_request("b", 5, max_tokens=50), "B")
    for request in (a0, b):
        scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.apply(out, StepResult(np.full(2, 7, np.int32)))
    scheduler.running.remove(b)
    scheduler._preempt(b)                             # swapped out, as under memory pressure
    assert b.status is RequestStatus.SWAPPED
    c = _with_adapter(make_request("c", 5, max_tokens=2), "C")
    scheduler.add_request(c)
    can_swap_in = scheduler.kv.can_swap_in
    scheduler.kv.can_swap_in = lambda request: False  # one step without room to swap b in
    scheduler.schedule()                              # C takes B's slot (B runs nowhere)
    scheduler.kv.can_swap_in = can_swap_in
    assert c.status is RequestStatus.RUNNING and scheduler.lora.slots.slot_of("B") is None
    a1 = _with_adapter(make_request("a1", 5), "A")   # its adapter is seated, but...
    scheduler.add_request(a1)
    out = scheduler.schedule()
    assert a1.status is RequestStatus.WAITING and b.status is RequestStatus.SWAPPED
    scheduler.finish_request("c", RequestStatus.FINISHED_ABORTED)
    scheduler.schedule()
    assert b.status is RequestStatus.RUNNING and b.lora_slot == scheduler.lora.slots.slot_of("B")
    assert a1.status is RequestStatus.RUNNING
