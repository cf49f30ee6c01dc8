"""Iteration-level continuous batching with chunked prefill and recompute preemption.

Every call to ``schedule`` decides which tokens of which requests run in the next model
step. Running requests are served first, oldest first: a decode takes one token, a
request still in prefill takes as much of its remaining prompt as the token budget
allows (chunked prefill, mixed with decodes in one step). When a running request needs
a block and none is free, the youngest running request is preempted by recompute: its
blocks are freed and it re-enters the front of the waiting queue, to be prefilled again
(prompt and outputs so far) when blocks allow. Waiting requests are admitted only after
all running ones were served and only if no preemption happened in this step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from jaxpage.config import SchedulerConfig
from jaxpage.core.kv_cache_manager import KVCacheManager
from jaxpage.core.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    """What runs in one step. The i-th scheduled request is sequence i of the batch."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request at any stage and free its blocks. Unknown ids: None."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
        return request

    # -- one iteration ---------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, out):
                break  # the request itself was preempted: nothing younger is left
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            index += 1
        if out.preempted:
            return out
        while (self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.kv.allocate_slots(request, num_new):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return out

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(request, num_new):
            victim = self.running.pop()  # youngest; never one already scheduled this step
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(self, out: SchedulerOutput,
                           sampled_token_ids: np.ndarray) -> list[tuple[Request, int]]:
        """Advance progress after a step; returns (request, new token) for each sampled one.

        ``sampled_token_ids[i]`` belongs to ``out.scheduled[i]``; it is only a real token
        when that request's step reached its last known token (no partial prefill).
        Requests that hit a token-level stop are finished and their blocks freed.
        """
        new_tokens = []
        for i, item in enumerate(out.scheduled):
            request = item.request
            if request.is_finished:
                continue  # aborted while the step ran
            request.num_computed_tokens += item.num_new_tokens
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk: its sampled token is meaningless
            token = int(sampled_token_ids[i])
            request.append_output_token(token)
            new_tokens.append((request, token))
            status = request.check_token_stop()
            if status is not None:
                self.finish_request(request.request_id, status)
        return new_tokens

    def stats(self) -> dict[str, int]:
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "num_preemptions": self.num_preemptions}
