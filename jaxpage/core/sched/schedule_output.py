"""What one step runs: ``SchedulerOutput``, its rows (``ScheduledRequest``), and the facts
a step scheduled ahead of the host carries (``AheadPlan``, ``DecodePositions``).

Invariants: row ``i`` of the output is sequence ``i`` of the batch built from it; an
output is never changed after the batch is built from it (facts learned while building
come back with the batch, ``core.batch.builder.BuiltBatch``), except that speculation gives a row
its proposals before the batch is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxpage.core.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One row of a step. A row scheduled ahead of the host (``AheadOfHost``) starts
    ``ahead`` computed tokens and ``sampled_ahead`` output tokens past what the request's
    state says; with ``sampled_ahead`` its first input token is the one the previous call
    sampled in row ``source_row``, still on the device."""

    request: Request
    num_new_tokens: int
    ahead: int = 0
    sampled_ahead: int = 0
    source_row: int = -1
    # Speculative proposals after the row's last token (they count in num_new_tokens).
    draft_token_ids: list[int] | tuple = ()
    # A draft model's proposals: the row of its last propose call (their q), else -1.
    draft_q_row: int = -1


@dataclass(slots=True)
class DecodePositions:
    """Where each row of a run of steady decode steps writes its token, known without a
    pass over the rows: row ``i`` writes position ``base[i] + offset``. The rows whose
    token starts a block are found by residue: ``by_residue[r]`` lists the rows with
    ``base[i] % block_size == r``, in row order."""

    base: list[int]
    by_residue: list[list[int]]
    offset: int = 0

    @classmethod
    def of(cls, positions: list[int], block_size: int) -> "DecodePositions":
        by_residue: list[list[int]] = [[] for _ in range(block_size)]
        for row, position in enumerate(positions):
            by_residue[position % block_size].append(row)
        return cls(positions, by_residue)

    def next(self) -> "DecodePositions":
        """The positions one step later (the same rows, one token further)."""
        return DecodePositions(self.base, self.by_residue, self.offset + 1)

    def position(self, row: int) -> int:
        return self.base[row] + self.offset

    def starting_block(self) -> list[int]:
        """The rows whose token is the first of a block, in row order."""
        return self.by_residue[-self.offset % len(self.by_residue)]


@dataclass(slots=True)
class AheadPlan:
    """How a step scheduled ahead of the host (``AheadOfHost.schedule_ahead``) was made.

    ``min_room``: the least ``max_tokens - num_output_tokens`` over its rows when it was
    made (no running request needed the host's view: no beam search, no fork due).
    ``continues`` (the steady state): row ``i`` is the decode that follows row ``i`` of
    that output, one token further, its input token on the device; ``positions`` then
    says where each row writes (its request's ``num_computed_tokens + 1`` when made)."""

    min_room: int
    continues: "SchedulerOutput | None" = None
    positions: DecodePositions | None = None


@dataclass
class SchedulerOutput:
    """What runs in one step: the rows, the requests preempted to make room, the number
    of speculative proposals over all rows (> 0 makes a verify step), and, for a step
    scheduled ahead of the host, how it was made (``ahead``)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_draft_tokens: int = 0
    ahead: AheadPlan | None = None
    _requests: list[Request] | None = None

    @property
    def requests(self) -> list[Request]:
        """The scheduled requests in row order (computed once; do not modify)."""
        if self._requests is None:
            self._requests = [item.request for item in self.scheduled]
        return self._requests

    @property
    def continues(self) -> "SchedulerOutput | None":
        """The output this one continues row for row (the steady state), else None."""
        return None if self.ahead is None else self.ahead.continues

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
