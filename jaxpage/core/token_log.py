"""Tokens of a run of steady decode steps, kept in one array until someone reads them.

In the steady state of decoding the same requests take one token each, step after step.
Appending each token to its request's list touches, per row, the request, its list and
the list's tail: after a long device step those are cache misses, and at 1,024 rows
they were most of the host's work per step. A ``TokenLog`` writes the step's tokens as
one row of an array instead. While a request is in a log it is a ``LoggedRequest`` (its
class is switched: same slots), whose ``all_token_ids`` and ``num_computed_tokens`` take
the logged tokens before they are read or written; a plain ``Request`` reads its slots
directly, so requests outside a log pay nothing. A request also takes its tokens when it
leaves the log (finished, preempted), and all of them at once when the log closes or
fills.

Invariants: the log's rows are ``requests`` in batch order, the same every logged step;
an attached request (``request._token_log is self``, a ``LoggedRequest``) has taken
``tokens[:its _log_from, its row]`` and not the rest; a detached one takes nothing more,
so a token logged for a request that finished while its step ran is dropped, as the
per-row path drops it.
"""

from __future__ import annotations

import numpy as np

from jaxpage.core.request import Request, RequestStatus

# Steps held before every request takes its tokens (a pass over the requests, as costly
# as one step of per-row appends): as many as fit in LOG_BYTES, within these bounds.
LOG_BYTES = 1 << 20
MIN_STEPS, MAX_STEPS = 64, 1024

# The slots themselves (``Request``'s member descriptors), under ``LoggedRequest``'s
# properties of the same names.
_ALL_TOKEN_IDS = Request.all_token_ids
_NUM_COMPUTED = Request.num_computed_tokens


class LoggedRequest(Request):
    """A ``Request`` whose newest tokens wait in a ``TokenLog`` (``_token_log``): the two
    attributes they change take them first. Only ``TokenLog`` makes one (by switching the
    class of a ``Request``, and back when it leaves)."""

    __slots__ = ()

    @property
    def all_token_ids(self) -> list[int]:
        self._token_log.sync(self)
        return _ALL_TOKEN_IDS.__get__(self)

    @all_token_ids.setter
    def all_token_ids(self, value: list[int]) -> None:
        self._token_log.sync(self)
        _ALL_TOKEN_IDS.__set__(self, value)

    @property
    def num_computed_tokens(self) -> int:
        self._token_log.sync(self)
        return _NUM_COMPUTED.__get__(self)

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        self._token_log.sync(self)
        _NUM_COMPUTED.__set__(self, value)


class TokenLog:
    def __init__(self, requests: list[Request], capacity: int | None = None) -> None:
        """Attach ``requests`` (rows in this order; each attached to no log), those still
        running: a row whose request finished while its step ran is dropped."""
        n = len(requests)
        self.requests = requests
        if capacity is None:
            capacity = min(max(LOG_BYTES // (4 * max(n, 1)), MIN_STEPS), MAX_STEPS)
        self.capacity = capacity
        self.tokens = np.empty((capacity, n), np.int32)                         # [steps, n]
        self.steps = 0
        # Tokens each row will have computed after the next logged step's (its block
        # boundaries); filled by ``track_computed``.
        self.computed: np.ndarray | None = None                                 # [n]
        self._streaming = [row for row, r in enumerate(requests) if r.streams_deltas]
        for row, request in enumerate(requests):
            if request._token_log is not None:
                raise ValueError(f"request {request.request_id!r} is already in a token log")
            if request.status is not RequestStatus.RUNNING:
                continue  # finished while its step ran (scheduled ahead): its row is dropped
            request._token_log = self
            request._log_row = row
            request._log_from = 0
            request.__class__ = LoggedRequest

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
                (_NUM_COMPUTED.__get__(r) + self.steps - r._log_from for r in self.requests),
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
            _take(request, self.tokens[first:self.steps, request._log_row].tolist())
            request._log_from = self.steps

    def detach(self, request: Request) -> None:
        """``sync`` ``request`` and take it off the log: later rows of it are dropped."""
        self.sync(request)
        _leave(request)

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
                _take(request, columns[row][request._log_from:])
            request._log_from = 0
            if detach:
                _leave(request)
        self.steps = 0


def _take(request: Request, tokens: list[int]) -> None:
    """Append logged ``tokens`` to ``request``'s slots, each one computed token more."""
    _ALL_TOKEN_IDS.__get__(request).extend(tokens)
    _NUM_COMPUTED.__set__(request, _NUM_COMPUTED.__get__(request) + len(tokens))


def _leave(request: Request) -> None:
    """A plain ``Request`` again, in no log."""
    request.__class__ = Request
    request._token_log = None
