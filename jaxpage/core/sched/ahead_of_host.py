"""Scheduling ahead of the host: the decisions made while a device call is still running.

A *row* of a step (``ScheduledRequest``) may start past what its request's state says,
because the call before it has not come back yet. Three decisions are made that way:

* ``reserve_multi_step``: may this schedule run several decode iterations in one call;
* ``chain_multi_step``: the same decodes again behind a multi-step call in flight;
* ``schedule_ahead``: the next single step behind a single step in flight (overlapped
  scheduling at ``num_scheduler_steps=1``): the in-flight tokens reach it on the device.

None of them preempts: that needs the host's whole view, so when blocks run short they
refuse, and the caller waits for the call in flight and schedules normally. Blocks
reserved before a refusal stay with their request and are used by its next steps.
A row scheduled for a request that then finishes (a stop token or string found when the
call before is processed, an abort) is discarded when its own call is processed; its K/V
write lands past the request's last token, in a block only it held (never a full block
that the prefix cache may share), and the block is free again by then.
"""

from __future__ import annotations

from jaxpage.core.sched.schedule_output import (AheadPlan, DecodePositions, ScheduledRequest,
                                                SchedulerOutput)


class AheadOfHost:
    """The scheduler's part that decides ahead of the host. It reads the scheduler's
    queues and uses its admission (``Scheduler.admit``); it keeps no state of its own."""

    # Tests set this: every fast path is checked against the path it shortcuts.
    check_fast_paths = False

    def __init__(self, scheduler) -> None:
        """``scheduler``: the ``core.sched.scheduler.Scheduler`` this part belongs to (not
        imported here: the scheduler imports this module)."""
        self.s = scheduler
        self.kv = scheduler.kv
        self.config = scheduler.config

    def reserve_multi_step(self, out: SchedulerOutput, num_steps: int) -> int:
        """How many decode iterations the device may run for ``out``: ``num_steps`` or 1.

        Several are allowed only when every scheduled request is a plain decode (no
        prefill chunk, no beam search, nothing preempted this step), counting rows
        scheduled ahead of the host at their ahead position; blocks for all of them are
        reserved here, up to each request's remaining ``max_tokens``.
        """
        s = self.s
        if (num_steps <= 1 or out.preempted or not out.scheduled or out.num_draft_tokens
                or s.speculating() or s.has_constrained):
            return 1  # speculating: the host proposes after every token; a grammar's
            # mask for the next token needs the one before
        s.applier.sync()  # the rows' progress is read below
        for item in out.scheduled:
            request = item.request
            if (item.num_new_tokens != 1 or request.external_sampling or request.fork_children
                    or request.num_computed_tokens + item.ahead
                    != len(request.all_token_ids) + item.sampled_ahead - 1):
                return 1
        for item in out.scheduled:
            request = item.request
            remaining = max(1, request.max_tokens - request.num_output_tokens - item.sampled_ahead)
            if not self.kv.allocate_slots(request, item.ahead + min(num_steps, remaining)):
                return 1  # blocks already taken stay with their request: used next steps
        return num_steps

    def chain_multi_step(self, out: SchedulerOutput, num_steps: int) -> SchedulerOutput | None:
        """Schedule the same decodes again while ``out``'s multi-step call still runs.

        The new schedule continues each request of ``out`` that outlives it (unfinished,
        with more than ``num_steps`` tokens to go), ``num_steps`` tokens past what the host
        knows (the device feeds it the last tokens). It is only
        made when nothing else could use the step: no request is swapped out, none waits
        for a free seat,
        every running request is in ``out`` (none was left out for budget), one of them
        can outlive the window (``max_tokens``), and blocks for another window fit without
        preemption. Returns None otherwise; blocks reserved before a failure stay with
        their request and are used by its next steps.
        """
        s = self.s
        if num_steps <= 1 or s.swapped or s.speculating() or s.has_constrained:
            return None  # speculating: few requests left, each step proposes again
        head = s.best_waiting() if s.waiting else None
        if head is not None and (s.seats_in_use() + head.num_seats
                                 <= self.config.max_num_seqs):
            return None  # a seat is free: admit the waiting request first
        s.applier.sync()  # the rows' progress is read below
        alive = [item.request for item in out.scheduled if not item.request.is_finished]
        if not alive or {id(r) for r in alive} != {id(r) for r in s.running}:
            return None
        # A request that ``out`` brings to ``max_tokens`` finishes there for certain (the
        # device stops it at its length): a row for it here would compute nothing.
        going_on = [r for r in alive if r.max_tokens - r.num_output_tokens > num_steps]
        if not going_on:
            return None
        for request in going_on:
            remaining = request.max_tokens - request.num_output_tokens
            if not self.kv.allocate_slots(request, min(2 * num_steps, remaining)):
                return None
        s.begin_step()
        return SchedulerOutput(scheduled=[ScheduledRequest(r, 1) for r in going_on])

    def schedule_ahead(self, previous: SchedulerOutput,
                       all_decodes: bool) -> SchedulerOutput | None:
        """Schedule the next single step while ``previous`` still runs, its tokens unknown.

        Every request of ``previous`` is taken as if that step had run: its prefill chunk
        computed, its sampled token appended (that token reaches the next step on the
        device, ``source_row``). A request that ``previous`` brings to ``max_tokens`` is
        left out; one that a stop token or stop string ends is found out when
        ``previous`` is processed, and its row of this step is discarded then. Waiting
        requests are admitted as usual. ``all_decodes``: the batch built from ``previous``
        was all decodes, each row emitting a token (``BuiltBatch.all_decodes``).

        Returns None (the caller then waits and schedules normally) when the host's
        knowledge is needed: beam search, an ``n > 1`` fork still to happen, swapped-out
        requests, or a running request whose blocks no longer fit (that needs a
        preemption). Blocks reserved before such a refusal stay with their request.
        """
        s = self.s
        if (s.swapped or not previous.scheduled or previous.num_draft_tokens
                or s.has_constrained):
            return None
        if s.speculating():
            return None  # proposals need the host to know every request's last token
        s.sort_running()
        steady = self._continue_decodes(previous, all_decodes)
        if steady is not None:
            if self.check_fast_paths:
                self._check_continued(previous, steady)
            return steady or None
        s.applier.release()  # the row by row path reads every request's progress
        return self._schedule_ahead_rows(previous)

    def _schedule_ahead_rows(self, previous: SchedulerOutput) -> SchedulerOutput | None:
        """``schedule_ahead`` request by request (any mix of prefills and decodes)."""
        in_flight = {id(item.request): (row, item.num_new_tokens)
                     for row, item in enumerate(previous.scheduled)}
        s = self.s
        out = SchedulerOutput()
        scheduled, row_of = out.scheduled, in_flight.get
        budget = self.config.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold
        req_to_blocks, block_size = self.kv.req_to_blocks, self.kv.block_size
        allocate = self.kv.allocate_slots
        not_in_flight = (-1, 0)
        for request in s.running:
            if request.external_sampling or request.fork_children:
                return None  # blocks reserved for earlier rows stay with their requests
            if budget <= 0:
                continue  # the rest only needs the check above
            row, ahead = row_of(id(request), not_in_flight)
            computed = request.num_computed_tokens + ahead
            known = len(request.all_token_ids)
            emits = ahead > 0 and computed >= known
            if emits and request.num_output_tokens + 1 >= request.max_tokens:
                continue  # its in-flight token is its last
            count = known + emits - computed
            if threshold and count > 1:
                count = min(count, threshold)
            num_new = min(count, budget)
            if num_new <= 0:
                continue
            # A row continuing an in-flight one writes after it: into that row's block
            # (already private) or a later one. Enough blocks held: nothing to allocate.
            if not (ahead and (computed + num_new - 1) // block_size
                    < len(req_to_blocks.get(request.request_id, ()))) and \
                    not allocate(request, ahead + num_new):
                return None  # needs a preemption: only the host's own schedule does that
            scheduled.append(ScheduledRequest(request, num_new, ahead, 1 if emits else 0,
                                              row if emits else -1))
            budget -= num_new
        s.begin_step()
        s.admit(out, budget)
        if not out.scheduled:
            return None
        out.ahead = AheadPlan(min(item.request.max_tokens - item.request.num_output_tokens
                                  for item in out.scheduled))
        return out

    def _continue_decodes(self, previous: SchedulerOutput,
                          all_decodes: bool) -> SchedulerOutput | bool | None:
        """The steady state of overlapped decoding, without a pass over the rows' state.

        When ``previous`` (in flight) is all decodes of exactly the running requests,
        planned ahead, and nothing can change the batch (no request reaches
        ``max_tokens`` with its in-flight token, none can be admitted), the next step is
        each row again, one token further, its input token on the device: what
        ``_schedule_ahead_rows`` would make, at the cost of checking the rows whose next
        token starts a block. Returns that output; False when such a row's block cannot
        be had (``schedule_ahead`` refuses); None when the state is not steady.
        """
        s = self.s
        running = s.running
        n = len(running)
        plan = previous.ahead
        if (not all_decodes or plan is None or plan.min_room <= 2
                or n != len(previous.scheduled) or n > self.config.max_num_batched_tokens
                or running != previous.requests):  # list equality: identities first
            return None
        # Every running request is plain (planned ahead), so each holds one seat.
        head = (s.best_waiting()
                if s.waiting and n < self.config.max_num_batched_tokens else None)
        if head is not None and n + head.num_seats <= self.config.max_num_seqs:
            return None  # a waiting request could be admitted: the row by row path does it
        # Row i computes the token after the one in flight: position num_computed + 1
        # (the in-flight row writes num_computed, so only a block's first slot is new).
        # Along a run of steady outputs every row is one further than in ``previous``
        # (exactly one step was applied since it was made), so the requests are not read;
        # neither is numpy called: after a long device step its code and data are cold.
        block_size = self.kv.block_size
        if plan.continues is not None and plan.positions is not None:
            positions = plan.positions.next()
        else:
            s.applier.sync()  # the requests' progress is read here
            positions = DecodePositions.of([r.num_computed_tokens + 1 for r in running],
                                           block_size)
        starting = positions.starting_block()
        if starting:
            requests = [running[row] for row in starting]
            counts = [positions.position(row) // block_size + 1 for row in starting]
            # One new block each, at once; else one by one (sharing, a window, too few).
            if not self.kv.append_blocks(requests, counts):
                s.applier.sync()  # allocate_slots reads each request's progress
                blocks = self.kv.req_to_blocks
                for request, count in zip(requests, counts):
                    if (count > len(blocks.get(request.request_id, ()))
                            and not self.kv.allocate_slots(request, 2)):
                        return False  # needs a preemption; blocks taken so far stay (as above)
        s.begin_step()
        scheduled = (previous.scheduled if plan.continues is not None
                     else [ScheduledRequest(r, 1, 1, 1, row) for row, r in enumerate(running)])
        return SchedulerOutput(scheduled, ahead=AheadPlan(plan.min_room - 1, previous, positions),
                               _requests=previous.requests)

    def _check_continued(self, previous: SchedulerOutput, steady: SchedulerOutput | bool) -> None:
        """``check_fast_paths``: the row by row path must agree with ``_continue_decodes``
        (blocks it allocated are already held, so only the step count is restored)."""
        s = self.s
        s.applier.sync()  # the row by row path reads the requests' progress
        step_count = s.step_count
        rows = self._schedule_ahead_rows(previous)
        s.step_count = step_count
        if steady is False:
            assert rows is None, "steady path refused a step the row by row path made"
            return
        expected = [(i.request, i.num_new_tokens, i.ahead, i.sampled_ahead, i.source_row)
                    for i in rows.scheduled] if rows is not None else None
        got = [(i.request, i.num_new_tokens, i.ahead, i.sampled_ahead, i.source_row)
               for i in steady.scheduled]
        assert expected == got, "steady path disagrees with the row by row path"
        assert steady.ahead.min_room <= rows.ahead.min_room
        assert ([steady.ahead.positions.position(row) for row in range(len(s.running))]
                == [r.num_computed_tokens + 1 for r in s.running]), \
            "steady path's carried positions disagree with the requests'"
