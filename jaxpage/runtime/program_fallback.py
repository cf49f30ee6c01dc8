"""``ProgramFallback``: while the engine's programs are still being built in the background,
a batch whose own program is not built yet runs padded in the smallest built program that
holds it (``core.batch.program_set.smallest_holding``), so no request waits for a compile.

The program a padded batch wanted is asked for next on the background thread (before the
rest of the set, which is built largest first), so a running workload soon runs in its
own programs.

Invariants: a batch only ever grows (every bucket dimension at least its own; padding by
``core.batch.program_set.pad_batch``, which keeps the rows' indices) and only moves to a program
that runs it (the device-decided program runs any batch; a host-decided one only the
batches whose features it has). When nothing built holds a batch (a kind outside the
program set), the batch is left as it is and its program
is built when it runs, as without a fallback.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from jaxpage.core.batch.batch_metadata import BatchMetadata
from jaxpage.core.batch.program_set import MODEL_KINDS, ProgramKey, pad_batch, smallest_holding


class ProgramFallback:
    """Picks, for each dispatched batch, a built program that runs it."""

    def __init__(self, keys: Iterable[ProgramKey], executables: Any,
                 empty: Callable[..., BatchMetadata],
                 request: Callable[[ProgramKey], None] | None = None) -> None:
        """``keys``: the engine's program set; ``executables``: its ``ExecutableCache``
        (what is built: ``holds``); ``empty``: ``BatchBuilder.empty``; ``request``: asks
        for a program of the set to be built next (called once per program, the first
        time a batch wants it unbuilt)."""
        self.keys = [k for k in keys if k.kind in MODEL_KINDS]
        self.executables = executables
        self.empty = empty
        self.request = request
        self.requested: set[ProgramKey] = set()
        self.num_padded = 0  # batches run in a larger program than their own

    def fit(self, batch: BatchMetadata, wanted: ProgramKey
            ) -> tuple[BatchMetadata, ProgramKey]:
        """(the batch, padded if needed, and the key of the program to run it in) for a
        batch whose own program is ``wanted``."""
        if self.executables.holds(wanted):
            return batch, wanted
        built = [k for k in self.keys if k.kind == wanted.kind and self.executables.holds(k)]
        if self.request is not None and wanted not in self.requested and wanted in self.keys:
            self.requested.add(wanted)
            self.request(wanted)  # the program this batch wants, next in the background
        choice = smallest_holding(wanted, built)
        if choice is None:
            return batch, wanted
        if choice.bucket != batch.shape_key:
            batch = pad_batch(batch, self.empty(*choice.bucket))
            self.num_padded += 1
        return batch, choice
