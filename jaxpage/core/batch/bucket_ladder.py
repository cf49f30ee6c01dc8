"""The bucket ladders that pad a batch's shapes, so the jitted step compiles a small set
of programs (see ``jaxpage.core.batch.builder``)."""

from __future__ import annotations

import bisect


class BucketLadder:
    """Powers of ``growth`` from ``minimum`` up to ``maximum`` (always the top rung).

    The first rung is ``minimum`` itself when it is not a power of ``growth``.
    """

    def __init__(self, minimum: int, maximum: int, growth: int = 2) -> None:
        if minimum < 1 or maximum < 1:
            raise ValueError(f"bucket bounds must be >= 1, got {minimum}..{maximum}")
        if growth < 2:
            raise ValueError(f"bucket growth must be >= 2, got {growth}")
        rungs = []
        size = 1
        while size < minimum:
            size *= growth
        if size > minimum and minimum < maximum:
            rungs.append(minimum)
        while size < maximum:
            rungs.append(size)
            size *= growth
        rungs.append(maximum)
        self.rungs = tuple(rungs)

    def fit(self, size: int) -> int:
        """Smallest rung >= size."""
        i = bisect.bisect_left(self.rungs, size)
        if i == len(self.rungs):
            raise ValueError(f"size {size} exceeds the largest bucket {self.rungs[-1]}")
        return self.rungs[i]
