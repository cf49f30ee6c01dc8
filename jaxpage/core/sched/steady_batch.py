"""The persistent batch of steady decoding: it owns the tokens of a run of decode steps of
the same requests, in one array, until someone needs them in the requests.

In the steady state of decoding the same requests take one token each, step after step.
Appending each token to its request's list touches, per row, the request, its list and
the list's tail: after a long device step those are cache misses, and at 1,024 rows they
were most of the host's work per step. A ``SteadyBatch`` writes a step's tokens as one
row of an array instead (``append``), and gives them to the requests at defined points.

Invariants:

* The rows are ``requests`` in batch order, the same every step of the run.
* An attached row's request has taken ``tokens[:taken[row], row]``: its own
  ``all_token_ids`` and ``num_computed_tokens`` lag by ``steps - taken[row]`` tokens.
  Nobody reads an attached request's progress without syncing it first.
* The defined sync points: the whole batch is released (synced, detached) before
  ``schedule``, before scheduling ahead row by row, and before any other way of applying
  tokens (``StepApplier.release``); synced and kept before a multi-step reservation or
  chain, before the steady path reads positions from the requests
  (``AheadOfHost._continue_decodes``), and before the batch builder builds from the
  requests (``BatchBuilder.sync_requests`` = ``Scheduler.sync_tokens``); a request alone
  is detached when it finishes or is preempted (``release_request``); a row is synced
  before the engine is given its request or its blocks are cached (``current``).
* A detached row takes nothing more: a token written for a request that finished while
  its step ran is dropped, as the per-row path drops it.
"""

from __future__ import annotations

import numpy as np

from jaxpage.core.request import Request, RequestStatus

# Steps held before every request takes its tokens (a pass over the requests, as costly
# as one step of per-row appends): as many as fit in LOG_BYTES, within these bounds.
LOG_BYTES = 1 << 20
MIN_STEPS, MAX_STEPS = 64, 1024


class SteadyBatch:
    def __init__(self, requests: list[Request], capacity: int | None = None) -> None:
        """Own the coming tokens of ``requests`` (rows in this order); a row whose request
        is no longer running (finished while its step ran) starts detached."""
        n = len(requests)
        self.requests = requests
        if capacity is None:
            capacity = min(max(LOG_BYTES // (4 * max(n, 1)), MIN_STEPS), MAX_STEPS)
        self.capacity = capacity
        self.tokens = np.empty((capacity, n), np.int32)                         # [steps, n]
        self.steps = 0
        self.taken = [0] * n  # steps each row's request has taken
        running = RequestStatus.RUNNING
        self.row_of = {id(r): row for row, r in enumerate(requests) if r.status is running}
        # Tokens each row will have computed after the next step's (its block
        # boundaries); filled by ``track_computed``.
        self.computed: np.ndarray | None = None                                 # [n]
        self._streaming = [row for row, r in enumerate(requests) if r.streams_deltas]

    @staticmethod
    def eligible(request: Request) -> bool:
        """Whether a token of ``request`` needs nothing from the host but its stop check
        on the device's ``may_stop`` rows: no stop strings, no stop ids past the device's
        list, no beam search, its first token already out; and no penalties (their batch
        is built from every request's tokens each step, which the batch would only delay)."""
        return not (request.has_stop_strings or request.has_many_stop_ids
                    or request.external_sampling or request.first_token_time is None
                    or request.sampling_params.has_penalties)

    def append(self, tokens: np.ndarray) -> None:
        """One step: ``tokens`` int [>= n], row i's token first for row i."""
        if self.steps == self.capacity:
            self._give_all(detach=False)
        self.tokens[self.steps] = tokens[:self.tokens.shape[1]]
        self.steps += 1
        if self.computed is not None:
            self.computed += 1

    def track_computed(self) -> np.ndarray:
        """int [n]: each row's computed-token count including the batch's steps (valid
        for attached rows); kept up to date by ``append`` from now on."""
        if self.computed is None:
            taken, steps = self.taken, self.steps
            self.computed = np.fromiter(
                (r.num_computed_tokens + steps - taken[row] for row, r in enumerate(self.requests)),
                np.int64, len(self.requests))
        return self.computed

    def streaming_rows(self) -> list[int]:
        """Rows whose request wants an output every step (``output_kind="delta"``)."""
        return self._streaming

    def current(self, row: int) -> Request | None:
        """Row ``row``'s request with every token of the batch taken; None when detached."""
        request = self.requests[row]
        if self.row_of.get(id(request)) != row:
            return None
        self._give(row)
        return request

    def detach(self, request: Request) -> None:
        """Give ``request`` its tokens and take it off the batch (no-op if not on it)."""
        row = self.row_of.pop(id(request), None)
        if row is not None:
            self._give(row)

    def sync(self) -> None:
        """Every attached request takes its tokens; they stay attached."""
        self._give_all(detach=False)

    def release(self) -> None:
        """Every attached request takes its tokens and leaves the batch."""
        self._give_all(detach=True)

    def _give(self, row: int) -> None:
        first, steps = self.taken[row], self.steps
        if first < steps:
            _take(self.requests[row], self.tokens[first:steps, row].tolist())
            self.taken[row] = steps

    def _give_all(self, detach: bool) -> None:
        """One pass over the attached rows; the array is empty afterwards (``steps`` 0)."""
        steps, taken = self.steps, self.taken
        columns = self.tokens[:steps].T.tolist() if steps else None            # [n][steps]
        for row in self.row_of.values():
            if steps:
                _take(self.requests[row], columns[row][taken[row]:])
        self.taken = [0] * len(self.requests)
        self.steps = 0
        if detach:
            self.row_of = {}


def _take(request: Request, tokens: list[int]) -> None:
    """Append ``tokens`` to ``request``, each one computed token more."""
    request.all_token_ids.extend(tokens)
    request.num_computed_tokens += len(tokens)
