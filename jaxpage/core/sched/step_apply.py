"""Applying a device call's sampled tokens to its requests: one ``StepApplier.apply`` for
every kind of call (a single step, a multi-step decode call, a speculative verify step),
from its ``core.sched.step_result.StepResult``.

Every token taken is the same four things: its predecessor counted computed, a block
that predecessor filled put in the prefix cache, the token appended, and a token-level
stop finishing the request. The strategy is chosen in one place (``_steady_batch``): a
single step of plain decodes continuing the steady run, whose every request needs nothing
but the device's stop flags, goes vectorized into the ``SteadyBatch`` (counting and
appending as one array write, no pass over the requests; the block caching and the stop
check, ``_stops``, on the rows that need them); everything else goes row by row
(``take``, one token at a time).

Invariants: a token is appended only once the K/V of every token before it is on the
device (``num_computed_tokens`` counts them); a request that stops is finished (its
blocks freed) before the next ``schedule``; no token is applied to a finished request
(aborted, or stopped while a call scheduled ahead of the host ran).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from jaxpage.core.request import Request, RequestStatus
from jaxpage.core.sched.schedule_output import SchedulerOutput
from jaxpage.core.sched.steady_batch import SteadyBatch
from jaxpage.core.sched.step_result import StepResult

if TYPE_CHECKING:
    from jaxpage.core.kv.kv_cache_manager import KVCacheManager
    from jaxpage.core.sched.speculation import Speculation

# ``on_token(request, index, step)``: the engine's per-token work after each token taken
# (log-probabilities, first-token time, stop strings). ``index`` is the token's row of the
# call's results (a verify step's: its token index) and ``step`` its step within a
# multi-step call (else None).
OnToken = Callable[[Request, int, "int | None"], None]


class StepApplier:
    """The scheduler's part that applies sampled tokens; owns the ``SteadyBatch`` of the
    current steady run (None outside one)."""

    def __init__(self, kv: "KVCacheManager", finish: Callable[[str, RequestStatus], object],
                 speculation: "Speculation | None") -> None:
        self.kv = kv
        self.block_size = kv.block_size
        self._finish = finish  # Scheduler.finish_request
        self.speculation = speculation
        self.steady: SteadyBatch | None = None
        self.num_steady_steps = 0  # steps applied through the steady batch (a statistic)

    # -- the steady batch's defined sync points ------------------------------------------

    def release(self) -> None:
        """Every request of the steady batch (if any) takes its tokens and leaves it."""
        steady, self.steady = self.steady, None
        if steady is not None:
            steady.release()

    def release_request(self, request: Request) -> None:
        """``request`` takes its tokens and leaves the steady batch (finished, preempted)."""
        if self.steady is not None:
            self.steady.detach(request)

    def sync(self) -> None:
        """Every request of the steady batch takes its tokens and stays in it: before
        anything reads the requests' progress without leaving the steady run (a
        multi-step reservation, the batch builder's build from the requests, the
        fast-path checks)."""
        if self.steady is not None:
            self.steady.sync()

    # -- one apply ------------------------------------------------------------------------

    def apply(self, out: SchedulerOutput, sampled: StepResult, *, all_decodes: bool,
              engine_sees_tokens: bool, cu_q_lens: np.ndarray | None = None,
              on_token: OnToken | None = None,
              on_distribution: Callable[[Request, int], None] | None = None) -> list[Request]:
        """Apply ``out``'s call results; returns the requests the engine reports on.

        ``cu_q_lens`` (int32 [S + 1], a verify step's): where each row's tokens start.

        ``all_decodes`` (``BuiltBatch.all_decodes``): every row of a single step is one
        token completing its request's known tokens, none beam search.
        ``engine_sees_tokens``: the engine has work per token (log-probabilities, grammars,
        KV transfer), so the steady batch may not hold the tokens back.
        ``on_distribution(request, row)`` takes a beam-search row's (``external_sampling``)
        distribution instead of a token. In the steady batch only rows that stream or
        finished are reported; otherwise every row that took a token.
        """
        steady = self._steady_batch(out, sampled, all_decodes, engine_sees_tokens)
        if steady is not None:
            return self._apply_steady(steady, sampled)
        self.release()
        if sampled.emitted is not None:
            if cu_q_lens is None:
                raise ValueError("a verify step's result needs its batch's cu_q_lens")
            return self._apply_verified(out, sampled, cu_q_lens, on_token)
        if sampled.tokens.ndim == 2:
            return self._apply_multi_step(out, sampled.tokens, on_token)
        return self._apply_single(out, sampled, on_token, on_distribution)

    def _steady_batch(self, out: SchedulerOutput, sampled: StepResult, all_decodes: bool,
                      engine_sees_tokens: bool) -> SteadyBatch | None:
        """The strategy's one predicate: the steady batch that takes this call's tokens,
        or None for the per-row path. It qualifies: a single step of plain decodes, none
        of whose tokens the engine must see, continuing the one before with the same
        requests (``out.continues``) or the open batch's own requests, every one
        ``SteadyBatch.eligible``."""
        if (not all_decodes or engine_sees_tokens or sampled.may_stop is None
                or sampled.emitted is not None or sampled.tokens.ndim != 1):
            return None
        requests = out.requests
        steady = self.steady
        if steady is not None and steady.requests is requests:
            return steady
        self.release()
        if out.continues is None or not all(map(SteadyBatch.eligible, requests)):
            return None
        self.steady = SteadyBatch(requests)
        return self.steady

    def _apply_steady(self, steady: SteadyBatch, sampled: StepResult) -> list[Request]:
        """Tokens into the steady batch in one array write; only rows ``may_stop`` flags
        and, when the prefix cache or a sliding window needs it, rows that complete a
        block read their request (synced first)."""
        steady.append(sampled.tokens)
        self.num_steady_steps += 1
        current = steady.current
        if self.kv.needs_full_blocks():
            computed = steady.track_computed()
            for row in np.flatnonzero(computed % self.block_size == 0).tolist():
                request = current(row)
                if request is not None:
                    self.kv.cache_full_blocks(request)
        report = [r for r in map(current, steady.streaming_rows()) if r is not None]
        for row in np.flatnonzero(sampled.may_stop[:len(steady.requests)]).tolist():
            request = current(row)
            if request is not None and self._stops(request) and not request.streams_deltas:
                report.append(request)
        return report

    def _apply_single(self, out: SchedulerOutput, sampled: StepResult,
                      on_token: OnToken | None,
                      on_distribution: Callable[[Request, int], None] | None) -> list[Request]:
        """A single step row by row. A row is a real token only when its step reached its
        request's last known token (no partial prefill)."""
        touched = []
        tokens = sampled.tokens.tolist()
        stops = None if sampled.may_stop is None else sampled.may_stop.tolist()
        cache_full_blocks = self.kv.cache_full_blocks
        for row, item in enumerate(out.scheduled):
            request = item.request
            if request.is_finished:
                continue  # aborted while the step ran (or a row scheduled ahead of a stop)
            computed = request.num_computed_tokens + item.num_new_tokens
            if computed < len(request.all_token_ids):
                request.num_computed_tokens = computed
                cache_full_blocks(request)
                continue  # a prefill chunk: its sampled token is meaningless
            if request.external_sampling:  # beam search: the engine picks the tokens
                request.num_computed_tokens = computed
                cache_full_blocks(request)
                if on_distribution is not None:
                    on_distribution(request, row)
                continue
            request.num_computed_tokens = computed - 1
            if item.num_new_tokens > 1:
                cache_full_blocks(request)  # blocks the chunk filled before its last token
            self.take(request, tokens[row], stops is None or stops[row])
            if on_token is not None:
                on_token(request, row, None)
            touched.append(request)
        return touched

    def _apply_multi_step(self, out: SchedulerOutput, tokens: np.ndarray,
                          on_token: OnToken | None) -> list[Request]:
        """A multi-step decode call (tokens [K, S]): each row's tokens up to its first -1
        (the device stopped it by the same rules the host checks)."""
        touched = []
        for row, item in enumerate(out.scheduled):
            request = item.request
            if request.is_finished:
                continue  # finished (or aborted) while this call was queued or running
            for step, token in enumerate(tokens[:, row].tolist()):
                if token < 0 or request.is_finished:
                    break
                self.take(request, token)
                if on_token is not None:
                    on_token(request, row, step)
            touched.append(request)
        return touched

    def _apply_verified(self, out: SchedulerOutput, sampled: StepResult,
                        cu_q_lens: np.ndarray, on_token: OnToken | None) -> list[Request]:
        """A verify step: each row's emitted tokens (its accepted proposals, then the
        correction or bonus token), each taken like any token (tokens past a stop are
        dropped); then the blocks only rejected proposals reached go back to the pool."""
        touched = []
        cu_q_lens = cu_q_lens.tolist()
        tokens, emitted = sampled.tokens.tolist(), sampled.emitted.tolist()
        for row, item in enumerate(out.scheduled):
            request = item.request
            if request.is_finished:
                continue  # aborted while the step ran
            start, end = cu_q_lens[row], cu_q_lens[row + 1]
            count = sum(emitted[start:end])  # a prefix of the row: up to its first rejection
            for index in range(start, start + count):
                if request.is_finished:
                    break
                self.take(request, tokens[index])
                if on_token is not None:
                    on_token(request, index, None)
            if not request.is_finished:
                self.kv.free_tail(request)
            if self.speculation is not None:
                self.speculation.stats.record(len(item.draft_token_ids), count - 1)
            touched.append(request)
        return touched

    # -- one token --------------------------------------------------------------------------

    def take(self, request: Request, token: int, may_stop: bool = True) -> bool:
        """Take a token whose predecessor's K/V the device just wrote; True if it stops.

        Counts that predecessor as computed, caches a block it filled, appends the token,
        and finishes the request (freeing its blocks) on a token-level stop. ``may_stop``
        False skips the stop check (the device's flags say the token cannot stop it)."""
        computed = request.num_computed_tokens + 1
        request.num_computed_tokens = computed
        if computed % self.block_size == 0:
            self.kv.cache_full_blocks(request)
        request.all_token_ids.append(token)
        if may_stop or request.has_many_stop_ids:
            return self._stops(request)
        return False

    def _stops(self, request: Request) -> bool:
        """Finish ``request`` if its last token stops it; whether it did."""
        status = request.check_token_stop()
        if status is None:
            return False
        self._finish(request.request_id, status)
        return True
