"""``ProgramFallback``: while the engine's programs are still being built in the background,
a batch whose own program is not built yet runs padded in the smallest built program that
holds it (``core.program_set.smallest_holding``), so no request waits for a compile.

The program a padded batch wanted is asked for next on the background thread (before the
rest of the set, which is built largest first), so a running workload soon runs in its
own programs.

Invariants: a batch only ever grows (every bucket dimension at least its own; padding by
``core.program_set.pad_batch``, which keeps the rows' indices) and only moves to a program
that runs it (the device-decided program runs any batch; a host-decided one only the
batches whose features it has). When nothing built holds a batch (a kind outside the
program set), the batch is left as it is and its program
is built when it runs, as without a fallback.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from jaxpage.core.batch_metadata import BatchMetadata
from jaxpage.core.program_set import ProgramKey, pad_batch, smallest_holding
from jaxpage.core.step_features import BASE_FEATURES, StepFeatures


class ProgramFallback:
    """Picks, for each dispatched batch, a built program that runs it."""

    def __init__(self, keys: Iterable[ProgramKey], programs: Any, executables: Any,
                 empty: Callable[..., BatchMetadata],
                 request: Callable[[ProgramKey], None] | None = None) -> None:
        """``keys``: the engine's program set; ``programs``: its ``StepPrograms`` (names);
        ``executables``: its ``ExecutableCache`` (what is built: ``holds``); ``empty``:
        ``BatchBuilder.empty``; ``request``: asks for a program of the set to be built
        next (called once per program, the first time a batch wants it unbuilt)."""
        self.keys = [k for k in keys if k.kind in ("step", "step-masked", "decode", "verify")]
        self.programs = programs
        self.executables = executables
        self.empty = empty
        self.request = request
        self.requested: set[ProgramKey] = set()
        self.num_padded = 0  # batches run in a larger program than their own

    def _features(self, key: ProgramKey) -> StepFeatures | None:
        """The features a key's program is made with (None: decided on the device)."""
        if key.device_decided or not self.programs.host_decides_branches:
            return None
        return BASE_FEATURES

    def _name(self, key: ProgramKey, base: str) -> str:
        features = self._features(key)
        if key.kind == "decode":
            return self.programs.decode(key.steps, features)[0]
        return self.programs.name(base, features)

    def fit(self, kind: str, batch: BatchMetadata, features: StepFeatures | None, steps: int,
            base: str = "step") -> tuple[BatchMetadata, StepFeatures | None]:
        """(the batch, padded if needed, and the features of the program to run it in).
        ``base``: the program's base name ("step", "verify-q1", ...)."""
        device = features is None and self.programs.host_decides_branches
        wanted = ProgramKey(kind, batch.shape_key, steps, device)
        if self.executables.holds(self._name(wanted, base), wanted.bucket):
            return batch, features
        built = [k for k in self.keys if k.kind == kind and k.steps == steps
                 and self.executables.holds(self._name(k, base), k.bucket)]
        if self.request is not None and wanted not in self.requested and wanted in self.keys:
            self.requested.add(wanted)
            self.request(wanted)  # the program this batch wants, next in the background
        choice = smallest_holding(wanted, built)
        if choice is None:
            return batch, features
        if choice.bucket != batch.shape_key:
            batch = pad_batch(batch, self.empty(*choice.bucket))
            self.num_padded += 1
        return batch, self._features(choice) if not device else None
