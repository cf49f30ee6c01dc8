"""Iteration-level continuous batching: chunked prefill, prefix caching, preemption, policies.

Every call to ``schedule`` decides which tokens of which requests run in the next model
step, in this order:

1. Running requests, best first (FCFS: oldest first; priority: lowest aged priority
   first). A decode takes one token; a request still in prefill takes as much of its
   remaining prompt as the token budget (and ``long_prefill_token_threshold``) allows,
   so prefill chunks mix with decodes in one step. When a running request needs a block
   and none is free, the worst running request is preempted: swapped to host memory or
   freed for recompute (``preemption_mode``; "auto" compares the estimated costs).
2. Swapped-out requests come back, oldest first, while blocks allow.
3. Waiting requests are admitted, best first, taking every block of their prompt that the
   prefix cache holds.

Steps 2 and 3 are skipped in a step that preempted, so a request is never admitted only
to push out an older one. Priority aging: every ``priority_aging_steps`` steps since its
arrival improve a request's priority by one, so no request starves.
"""

from __future__ import annotations

import itertools
import operator
from collections import deque

from jaxpage.config import SchedulerConfig
from jaxpage.core.kv.kv_cache_manager import KVCacheManager
from jaxpage.core.request import Request, RequestStatus
from jaxpage.core.sched.ahead_of_host import AheadOfHost
from jaxpage.core.sched.lora_seating import LoRASeating
from jaxpage.core.sched.lora_slots import LoRASlots
from jaxpage.core.sched.preemption import PreemptionCostModel
from jaxpage.core.sched.schedule_output import ScheduledRequest, SchedulerOutput
from jaxpage.core.sched.speculation import Speculation
from jaxpage.core.sched.step_apply import OnToken, StepApplier
from jaxpage.core.sched.step_result import StepResult


_ARRIVAL = operator.attrgetter("arrival_seq")


class Scheduler:
    """The queues and the admission, preemption and swap decisions (module docstring),
    with its parts as objects of their own: ``ahead`` (decisions made while a call runs,
    ``core.sched.ahead_of_host``), ``speculation`` (None when off), ``lora`` (adapter
    seating; None without LoRA) and ``applier`` (sampled tokens into the requests, and the
    steady batch of decoding).

    Invariant: ``step_count`` counts the outputs made (``begin_step``), whichever part
    made them."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 cost_model: PreemptionCostModel | None = None,
                 lora_slots: LoRASlots | None = None) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.cost_model = cost_model or PreemptionCostModel()
        self.waiting: deque[Request] = deque()
        self.swapped: list[Request] = []
        self.running: list[Request] = []
        # Set when a request joins ``running`` (appended or inserted): under FCFS the
        # list is sorted by arrival otherwise (removals keep the order).
        self._running_unsorted = False
        self.requests: dict[str, Request] = {}
        # Ids of the requests here with a grammar (``Request.grammar``): while any is,
        # calls are single steps scheduled by the host (see ``has_constrained``).
        self._constrained: set[str] = set()
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self.step_count = 0
        self._arrivals = itertools.count()
        self.speculation = (None if config.speculative is None else
                            Speculation(config.speculative, config.max_num_batched_tokens,
                                        kv_cache_manager))
        self.lora = None if lora_slots is None else LoRASeating(config, lora_slots)
        self.applier = StepApplier(kv_cache_manager, self.finish_request, self.speculation)
        self.ahead = AheadOfHost(self)

    # -- queue management -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        family = [request, *request.fork_children]
        for member in family:
            if member.request_id in self.requests:
                raise ValueError(f"request_id={member.request_id!r} is already in the engine")
        if request.num_seats > self.config.max_num_seqs:
            raise ValueError(f"request {request.request_id!r} needs {request.num_seats} "
                             f"sequences but max_num_seqs={self.config.max_num_seqs}")
        request.arrival_seq = next(self._arrivals)
        request.added_step = self.step_count
        for member in family:
            self.requests[member.request_id] = member
            if member.grammar is not None:
                self._constrained.add(member.request_id)
        for child in request.fork_children:
            child.status = RequestStatus.FORK_PENDING
        self.waiting.append(request)

    def add_prefilled(self, request: Request) -> None:
        """Add a request whose prompt another instance ran (disaggregated serving): its
        pages already sit in its host blocks (``KVCacheManager.adopt_host_blocks``) and
        its first token is in its output, so it joins as a swapped-out request and is
        swapped in, then decoded, when device blocks allow."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already in the engine")
        if request.fork_children:
            raise ValueError("n > 1 is not supported for a request prefilled elsewhere")
        request.arrival_seq = next(self._arrivals)
        request.added_step = self.step_count
        self.requests[request.request_id] = request
        if request.grammar is not None:
            self._constrained.add(request.request_id)
        request.status = RequestStatus.SWAPPED
        self.swapped.append(request)

    @property
    def has_constrained(self) -> bool:
        """Whether a request with a grammar is in the scheduler. Each of its tokens needs
        a mask the host computes from the token before, so no call may run ahead of the
        host: no multi-step calls, no steps scheduled ahead, no speculation."""
        return bool(self._constrained)

    def speculating(self) -> bool:
        """Whether steps may carry proposals now (``Speculation.active``): never while a
        request with a grammar is here (its rows would need a mask per proposal, and a
        verify step takes no mask)."""
        return (self.speculation is not None and not self._constrained
                and self.speculation.active(len(self.running)))

    def sync_tokens(self) -> None:
        """Give every request the tokens the steady batch holds for it (they stay in it):
        a sync point for whoever reads the requests' progress between steps (the batch
        builder before it builds from the requests, benchmarks, tests); see
        ``core.sched.steady_batch``."""
        self.applier.sync()

    def begin_step(self) -> None:
        """Count one more output made (priority aging reads the count)."""
        self.step_count += 1

    def apply(self, out: SchedulerOutput, sampled: StepResult, *, all_decodes: bool = False,
              engine_sees_tokens: bool = False, cu_q_lens=None,
              on_token: OnToken | None = None, on_distribution=None) -> list[Request]:
        """Apply a call's sampled tokens (``StepApplier.apply``); a grammar's request
        always sees its tokens."""
        return self.applier.apply(out, sampled, all_decodes=all_decodes,
                                  engine_sees_tokens=engine_sees_tokens or self.has_constrained,
                                  cu_q_lens=cu_q_lens, on_token=on_token,
                                  on_distribution=on_distribution)

    def adapters_in_use(self) -> set | None:
        """Keys of the adapters running requests use; None when LoRA is off."""
        return None if self.lora is None else self.lora.adapters_in_use(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request at any stage and free its blocks. Unknown ids: None."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.applier.release_request(request)  # its tokens so far, none after
        if self._constrained:
            self._constrained.discard(request_id)
            self._constrained.difference_update(c.request_id for c in request.fork_children)
        if request.kv_export and status is RequestStatus.FINISHED_LENGTH:
            # The blocks stay untouched until a later step reuses them; the engine gathers
            # them for the decode instance before dispatching anything else.
            blocks = self.kv.req_to_blocks.get(request_id, [])
            keep = self.kv.num_blocks_for(request.num_prompt_tokens)
            request.exported_blocks = [block.block_id for block in blocks[:keep]]
        for queue in (self.running, self.waiting, self.swapped):
            if request in queue:
                queue.remove(request)
                break
        if request.status is RequestStatus.FORK_PENDING and request.fork_leader is not None:
            request.fork_leader.fork_children.remove(request)  # never born
        for child in request.fork_children:  # unborn siblings die with their leader
            self.requests.pop(child.request_id, None)
            child.status = status
        request.fork_children = []
        self.kv.free(request)
        request.status = status
        return request

    def sort_running(self) -> None:
        if self.config.scheduling_policy == "fcfs":
            if self._running_unsorted:  # the key reads every request: skip it when sorted
                self.running.sort(key=_ARRIVAL)  # C-level key; nearly sorted already: O(n)
                self._running_unsorted = False
        else:
            self.running.sort(key=self._priority_key)

    def best_waiting(self, adapters: set | None = None) -> Request | None:
        """The waiting request to admit next. Under FCFS it is the head of the queue, in
        O(1): requests arrive in order, and a preempted (or forked) one goes back to the
        head having arrived before every request still waiting. Priorities age with the
        step count, so that policy compares every waiting request.

        With LoRA slots, ``adapters`` holds the adapters running requests use: requests
        whose adapter could not be seated now are passed over (None if all are), but
        not for ever: once one has waited ``priority_aging_steps`` steps, no request is
        admitted past it (the running requests drain until its adapter gets a slot)."""
        if self.lora is not None:
            if adapters is None:
                adapters = self.lora.adapters_in_use(self.running)
            return self.lora.best_seatable(self.waiting, adapters, self.step_count,
                                           self._priority_key)
        if self.config.scheduling_policy == "fcfs":
            return self.waiting[0]
        return min(self.waiting, key=self._priority_key)

    def _priority_key(self, request: Request) -> tuple[int, int]:
        if self.config.scheduling_policy == "fcfs":
            return (0, request.arrival_seq)
        aged = (self.step_count - request.added_step) // self.config.priority_aging_steps
        return (request.priority - aged, request.arrival_seq)

    def seats_in_use(self) -> int:
        return sum(r.num_seats for r in self.running)

    def _num_new_tokens(self, request: Request, budget: int, num_computed: int) -> int:
        end = request.fork_at if request.fork_children else request.num_tokens
        count = end - num_computed
        threshold = self.config.long_prefill_token_threshold
        if threshold and count > 1:
            count = min(count, threshold)
        return max(0, min(count, budget))

    # -- one iteration ----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.applier.release()  # the loop below reads every request's progress
        self.begin_step()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.sort_running()
        running, scheduled, allocate = self.running, out.scheduled, self.kv.allocate_slots
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            if request.fork_children:
                if request.num_computed_tokens >= request.fork_at:
                    self._fork(request, index)
                num_new = self._num_new_tokens(request, budget, request.num_computed_tokens)
            elif request.num_computed_tokens == len(request.all_token_ids) - 1:
                num_new = 1  # a decode: the hot path, one row of every step
            else:
                num_new = self._num_new_tokens(request, budget, request.num_computed_tokens)
            if num_new == 0:
                index += 1
                continue
            if not allocate(request, num_new) and not self._allocate_or_preempt(
                    request, num_new, out):
                break  # the request itself was preempted: nothing worse is left
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            index += 1
        if not out.preempted:
            budget, adapter_blocked = self._swap_in(out, budget)
            if not adapter_blocked:  # else new work waits: the swapped request comes first
                self.admit(out, budget)
        if out.scheduled and self.speculating():
            self.speculation.propose(out)  # the host's proposer; a draft model's: the engine's
        return out

    def _fork(self, request: Request, index: int) -> None:
        for offset, child in enumerate(request.fork_children, start=1):
            self.kv.fork(request, child)
            child.num_computed_tokens = request.num_computed_tokens
            child.status = RequestStatus.RUNNING
            child.arrival_seq = request.arrival_seq
            child.added_step = request.added_step
            child.fork_leader = None
            self.running.insert(index + offset, child)
            self._running_unsorted = True
        request.fork_children = []

    def fork_running(self, parent: Request, child_id: str) -> Request:
        """A new sequence sharing ``parent``'s tokens and blocks (beam search).

        A running parent's blocks are shared by reference count (copy-on-write later). A
        parent without device blocks (preempted or swapped) gives a child that recomputes.
        """
        if child_id in self.requests:
            raise ValueError(f"request_id={child_id!r} is already in the engine")
        child = parent.fork(child_id, parent.sample_seed)
        child.fork_leader = None
        self.requests[child_id] = child
        if parent.status is RequestStatus.RUNNING:
            self.kv.fork(parent, child)
            child.status = RequestStatus.RUNNING
            self.running.insert(self.running.index(parent) + 1, child)
            self._running_unsorted = True
        else:
            child.num_computed_tokens = 0
            child.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(child)
        return child

    def _swap_in(self, out: SchedulerOutput, budget: int) -> tuple[int, bool]:
        """Swap in what fits; (budget left, whether the next swapped request waits for a
        LoRA slot: then no waiting request is admitted, or steady traffic of the seated
        adapters would keep its adapter out for ever)."""
        if not self.swapped:
            return budget, False
        self.swapped.sort(key=self._priority_key)
        adapters = self.adapters_in_use()
        while (self.swapped and budget > 0
               and self.seats_in_use() + self.swapped[0].num_seats <= self.config.max_num_seqs):
            request = self.swapped[0]
            if adapters is not None and not self.lora.may_seat(request, adapters):
                return budget, True
            if not self.kv.can_swap_in(request):
                break
            self.kv.swap_in(request)
            if adapters is not None:
                self.lora.seat(request, adapters)
            self.swapped.pop(0)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._running_unsorted = True
            num_new = self._num_new_tokens(request, budget, request.num_computed_tokens)
            if num_new and self.kv.allocate_slots(request, num_new):
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
        return budget, False

    def admit(self, out: SchedulerOutput, budget: int) -> None:
        if not self.waiting:
            return
        seats = self.seats_in_use()
        adapters = self.adapters_in_use()
        while self.waiting and budget > 0:
            request = self.best_waiting(adapters)
            if request is None:  # every waiting request needs an adapter slot in use
                break
            if seats + request.num_seats > self.config.max_num_seqs:
                break
            computed = self.kv.get_computed_blocks(request)
            num_cached = len(computed) * self.kv.block_size
            num_computed = request.num_computed_tokens + num_cached
            num_new = self._num_new_tokens(request, budget, num_computed)
            if not self.kv.allocate_slots(request, num_new, computed):
                break
            if request.num_cached_tokens is None:  # first admission: count the prompt lookup
                request.num_cached_tokens = num_cached
                self.kv.record_prefix_lookup(request.num_prompt_tokens, num_cached)
            request.num_computed_tokens = num_computed
            if self.waiting[0] is request:
                self.waiting.popleft()
            else:
                self.waiting.remove(request)
            seats += request.num_seats
            if adapters is not None:
                self.lora.seat(request, adapters)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._running_unsorted = True
            if num_new:
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(request, num_new):
            victim = self.running.pop()  # the worst; never one already scheduled this step
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.applier.release_request(request)
        self.num_preemptions += 1
        request.num_preemptions += 1
        num_blocks = self.kv.num_live_blocks(request.request_id)
        mode = self.config.preemption_mode
        swap = mode == "swap" or (mode == "auto" and self.cost_model.prefer_swap(
            num_blocks, request.num_computed_tokens))
        if swap and num_blocks and self.kv.can_swap_out(request):
            self.kv.swap_out(request)
            self.num_swap_preemptions += 1
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
            return
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def stats(self) -> dict[str, int | float]:
        queried = self.kv.num_prefix_queried_tokens
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "num_swapped": len(self.swapped), "num_preemptions": self.num_preemptions,
                "num_swap_preemptions": self.num_swap_preemptions,
                "prefix_cache_hit_rate": self.kv.num_prefix_hit_tokens / queried if queried else 0.0,
                "num_cached_blocks": len(self.kv.block_pool.cached_blocks),
                "num_swap_in_shared_blocks": self.kv.num_swap_in_shared_blocks,
                **(self.speculation.stats.as_dict() if self.speculation is not None else {}),
                **(self.lora.stats(self.running, self.waiting) if self.lora is not None else {})}

