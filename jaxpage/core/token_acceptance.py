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


class TokenAcceptance:
    """Mixed into ``Scheduler``; uses its ``kv`` and ``finish_request``."""

    kv: KVCacheManager

    def update_from_output(self, out: SchedulerOutput, sampled_token_ids: np.ndarray,
                           may_stop: np.ndarray | None = None) -> list[tuple[Request, int]]:
        """Advance progress after a single step; returns (request, batch row) per new token.

        A row is only a real token when that request's step reached its last known token
        (no partial prefill). Tokens of ``external_sampling`` requests (beam search) are
        chosen by the engine instead of appended here. ``may_stop`` (int or bool [S], optional)
        marks the rows whose token could end their request; the others skip the stop
        check (the caller guarantees it would find nothing).
        """
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
