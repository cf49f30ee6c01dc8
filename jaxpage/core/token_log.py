"""Tokens of a run of steady decode steps, kept in one array until someone reads them.

In the steady state of decoding the same requests take one token each, step after step.
Appending each token to its request's list touches, per row, the request, its list and
the list's tail: after a long device step those are cache misses, and at 1,024 rows
they were most of the host's work per step. A ``TokenLog`` writes the step's tokens as
one row of an array instead; a request takes its logged tokens (and counts them as
computed) the moment its ``all_token_ids`` or ``num_computed_tokens`` is read
(``Request``'s properties call ``sync``), when it leaves the log (finished, preempted),
or all at once when the log closes or fills.

Invariants: the log's rows are ``requests`` in batch order, the same every logged step;
an attached request (``request._token_log is self``) has taken ``tokens[:its
_log_from, its row]`` and not the rest; a detached one takes nothing more, so a token
logged for a request that finished while its step ran is dropped, as the per-row path
drops it.
"""

from __future__ import annotations

import numpy as np

from jaxpage.core.request import Request, RequestStatus

DEFAULT_CAPACITY = 64  # steps held before every request takes its tokens (one pass)


class TokenLog:
    def __init__(self, requests: list[Request], capacity: int = DEFAULT_CAPACITY) -> None:
        """Attach ``requests`` (rows in this order; each attached to no log), those still
        running: a row whose request finished while its step ran is dropped."""
        n = len(requests)
        self.requests = requests
        self.capacity = capacity
        self.tokens = np.empty((capacity, n), np.int32)                         # [steps, n]
        self.steps = 0
        # Tokens each row will have computed after the next logged step's (its block
        # boundaries); filled by ``track_computed``.
        self.computed: np.ndarray | None = None                                 # [n]
        self.num_detached = 0
        self._streaming = [row for row, r in enumerate(requests) if r.streams_deltas]
        for row, request in enumerate(requests):
            if request._token_log is not None:
                raise ValueError(f"request {request.request_id!r} is already in a token log")
            if request.status is not RequestStatus.RUNNING:
                self.num_detached += 1
                continue  # finished while its step ran (scheduled ahead): its row is dropped
            request._token_log = self
            request._log_row = row
            request._log_from = 0

    @staticmethod
    def eligible(request: Request) -> bool:
        """Whether a token of ``request`` needs nothing from the host but its stop check
        on the device's ``may_stop`` rows: no stop strings, no stop ids past the device's
        list, no beam search, its first token already out; and no penalties (their batch
        is built from every request's tokens each step, which a log would only delay)."""
        return not (request.has_stop_strings or request.has_many_stop_ids
                    or request.external_sampling or request.first_token_time is None
                    or request.sampling_params.has_penalties)

    def append(self, tokens: np.ndarray) -> None:
        """Log one step: ``tokens`` int [>= n], row i's token first for row i."""
        if self.steps == self.capacity:
            self._apply_all(detach=False)
        self.tokens[self.steps] = tokens[:self.tokens.shape[1]]
        self.steps += 1
        if self.computed is not None:
            self.computed += 1

    def track_computed(self) -> np.ndarray:
        """int [n]: each row's computed-token count including the logged steps (valid
        for attached rows); kept up to date by ``append`` from now on."""
        if self.computed is None:
            self.computed = np.fromiter(
                (r._num_computed_tokens + self.steps - r._log_from for r in self.requests),
                np.int64, len(self.requests))
        return self.computed

    def streaming_rows(self) -> list[int]:
        """Rows whose request wants an output every step (``output_kind="delta"``)."""
        return self._streaming

    def is_attached(self, row: int) -> bool:
        return self.requests[row]._token_log is self

    def sync(self, request: Request) -> None:
        """Give ``request`` (attached) the tokens logged since it last took them."""
        first = request._log_from
        if first < self.steps:
            new = self.tokens[first:self.steps, request._log_row].tolist()
            request._all_token_ids += new
            request._num_computed_tokens += len(new)
            request._log_from = self.steps

    def detach(self, request: Request) -> None:
        """``sync`` ``request`` and take it off the log: later rows of it are dropped."""
        self.sync(request)
        request._token_log = None
        self.num_detached += 1

    def close(self) -> None:
        """Every attached request takes its tokens and leaves the log."""
        self._apply_all(detach=True)

    def _apply_all(self, detach: bool) -> None:
        """One pass over the rows: each attached request takes its logged tokens; the
        log is then empty (``steps`` 0)."""
        steps = self.steps
        columns = self.tokens[:steps].T.tolist() if steps else None            # [n][steps]
        for row, request in enumerate(self.requests):
            if request._token_log is not self:
                continue
            if steps:
                first = request._log_from
                new = columns[row][first:] if first else columns[row]
                request._all_token_ids += new
                request._num_computed_tokens += len(new)
            request._log_from = 0
            if detach:
                request._token_log = None
        self.steps = 0
