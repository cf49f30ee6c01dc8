"""The scheduler's part that applies a step's sampled tokens to its requests: progress
counted, full blocks put in the prefix cache, tokens appended, token-level stops found.

Invariant kept: a token is appended only once the K/V of every token before it is on
the device (``num_computed_tokens`` counts them), and a request that stops is finished
(its blocks freed) before the next ``schedule``.
"""

from __future__ import annotations

import itertools

import numpy as np

from jaxpage.core.kv_cache_manager import KVCacheManager
from jaxpage.core.request import FINISHED_IDS, Request
from jaxpage.core.schedule_ahead import SchedulerOutput
from jaxpage.core.token_log import TokenLog


class TokenAcceptance:
    """Mixed into ``Scheduler``; uses its ``kv`` and ``finish_request``.

    ``accept_logged_decodes`` is the steady state's path (tokens into a ``TokenLog``);
    every other way of applying tokens closes the log first, so while a log is open it is
    the only thing that adds tokens to its requests.
    """

    kv: KVCacheManager
    _token_log: TokenLog | None = None
    num_logged_steps = 0  # steps applied through the token log (a statistic)

    def close_token_log(self) -> None:
        """Every request of the open token log (if any) takes its tokens in one pass."""
        log, self._token_log = self._token_log, None
        if log is not None:
            log.close()

    def accept_logged_decodes(self, out: SchedulerOutput, sampled_token_ids: np.ndarray,
                              may_stop: np.ndarray) -> list[Request] | None:
        """``accept_decodes`` for the steady state, without a pass over the requests;
        returns the requests the engine must report on (those that stream deltas or
        finished), or None when this step does not qualify (the caller then takes
        ``accept_decodes``).

        Qualifies: a step of plain decodes continuing the one before with the same
        requests (``out.continues``) or the open log's own requests, every one
        ``TokenLog.eligible``. Its tokens go into the log in one array write; only rows
        ``may_stop`` flags (int [S]: a superset of the rows that stop, ``step.may_stop``)
        and, when the prefix cache or a sliding window needs it, rows that complete a
        block read their request.
        """
        requests = out.requests
        log = self._token_log
        if log is None or log.requests is not requests:
            self.close_token_log()
            if out.continues is None or not all(map(TokenLog.eligible, requests)):
                return None
            log = self._token_log = TokenLog(requests)
        log.append(sampled_token_ids)
        self.num_logged_steps += 1
        n = len(requests)
        if self.kv.needs_full_blocks():
            computed = log.track_computed()
            for row in np.flatnonzero(computed % self.kv.block_size == 0).tolist():
                if log.is_attached(row):
                    self.kv.cache_full_blocks(requests[row])
        report = [requests[row] for row in log.streaming_rows() if log.is_attached(row)]
        for row in np.flatnonzero(may_stop[:n]).tolist():
            request = requests[row]
            if not log.is_attached(row):
                continue  # finished (or aborted) while its step ran: its token is dropped
            status = request.check_token_stop()
            if status is not None:
                self.finish_request(request.request_id, status)
                if not request.streams_deltas:
                    report.append(request)
        return report

    def update_from_output(self, out: SchedulerOutput, sampled_token_ids: np.ndarray,
                           may_stop: np.ndarray | None = None) -> list[tuple[Request, int]]:
        """Advance progress after a single step; returns (request, batch row) per new token.

        A row is only a real token when that request's step reached its last known token
        (no partial prefill). Tokens of ``external_sampling`` requests (beam search) are
        chosen by the engine instead of appended here. ``may_stop`` (int or bool [S], optional)
        marks the rows whose token could end their request; the others skip the stop
        check (the caller guarantees it would find nothing).
        """
        self.close_token_log()
        produced = []
        tokens = sampled_token_ids.tolist()
        stops = None if may_stop is None else may_stop.tolist()
        if out.all_decodes:
            rows = [row for row, request in enumerate(out.requests) if not request.is_finished]
            return list(zip(self.accept_decodes(out, sampled_token_ids, may_stop), rows))
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
            produced.append((request, row))
            if request.external_sampling:
                request.num_computed_tokens = computed
                cache_full_blocks(request)
                continue
            request.num_computed_tokens = computed - 1
            if item.num_new_tokens > 1:
                cache_full_blocks(request)  # blocks the chunk filled before its last token
            self.accept_token(request, tokens[row], stops is None or stops[row])
        return produced

    def accept_decodes(self, out: SchedulerOutput, sampled_token_ids: np.ndarray,
                       may_stop: np.ndarray | None = None,
                       follow_up: list[Request] | None = None) -> list[Request]:
        """``update_from_output`` for a step of decodes only (``out.all_decodes``); returns
        the requests that took their token, in row order.

        Every row is one token completing its request's known tokens, none is beam search,
        so each unfinished row's request takes ``accept_token``'s steps, inlined: this is
        the hot loop of decoding (one pass over the requests, no per-row call).
        ``follow_up``, when given, receives (in the same pass) those of them still without
        a ``first_token_time`` or with stop strings: the engine's per-token work.
        """
        self.close_token_log()
        skipped: set[int] | None = None  # ids of requests that took no token (rare)
        block_size = self.kv.block_size
        cache_full_blocks = self.kv.cache_full_blocks
        finished = FINISHED_IDS
        stops = itertools.repeat(True) if may_stop is None else may_stop.tolist()
        requests = out.requests
        for request, token, stop in zip(requests, sampled_token_ids.tolist(), stops):
            if id(request.status) in finished:
                skipped = skipped or set()
                skipped.add(id(request))
                continue  # aborted, or stopped while it ran
            computed = request.num_computed_tokens + 1
            request.num_computed_tokens = computed
            if computed % block_size == 0:
                cache_full_blocks(request)
            request.all_token_ids.append(token)
            if follow_up is not None and (request.first_token_time is None
                                          or request.has_stop_strings):
                follow_up.append(request)
            if stop or request.has_many_stop_ids:
                status = request.check_token_stop()
                if status is not None:
                    self.finish_request(request.request_id, status)
        if skipped is None:
            return list(requests)
        return [request for request in requests if id(request) not in skipped]

    def accept_token(self, request: Request, token: int, may_stop: bool = True) -> bool:
        """Append a token whose predecessor's K/V the device just wrote; True if it stops.

        Counts that predecessor as computed, caches a block it filled, and finishes the
        request (freeing its blocks) on a token-level stop. ``may_stop=False`` skips the
        stop check (the caller knows the token cannot stop the request).
        """
        if self._token_log is not None:
            self.close_token_log()
        request.num_computed_tokens += 1
        if request.num_computed_tokens % self.kv.block_size == 0:
            self.kv.cache_full_blocks(request)
        request.all_token_ids.append(token)
        if not (may_stop or request.has_many_stop_ids):
            return False
        status = request.check_token_stop()
        if status is not None:
            self.finish_request(request.request_id, status)
            return True
        return False
