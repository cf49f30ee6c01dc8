"""``compile_ahead``: which programs a running workload will need next, asked for early.

As requests finish, an all-decode batch shrinks through the decode seat rungs
(``BatchShapes.decode_seats``) down to one sequence. ``DrainPrograms`` asks the runner to
build those programs on the background thread (``ModelRunner.prefetch``) while the
device runs the current call, so that the call which first needs one finds it built.

Invariants: each program is asked for at most once per engine; nothing is computed
unless the number of unfinished requests exceeds the most already covered at this
block-table width, so a step whose batch holds or drains costs a dictionary lookup.
"""

from __future__ import annotations

from typing import Any

from jaxpage.config import SchedulerConfig
from jaxpage.core.batch.builder import BatchBuilder
from jaxpage.core.batch.batch_metadata import BatchMetadata


class DrainPrograms:
    """Asks for the all-decode programs of every batch size below the current one."""

    def __init__(self, builder: BatchBuilder, num_steps: int, max_num_seqs: int) -> None:
        self.builder = builder
        self.num_steps = num_steps  # the kind of decode call: K iterations (1: plain steps)
        self.max_num_seqs = max_num_seqs
        self.asked: set[tuple[int, int, int, int]] = set()  # (T, S, M, steps) asked for
        self._covered: dict[int, int] = {}  # width -> most sequences whose programs were asked

    @classmethod
    def for_config(cls, config: SchedulerConfig, builder: BatchBuilder,
                   runner: Any) -> "DrainPrograms | None":
        """The engine's, or None when ``compile_ahead`` is off (None: off on the CPU,
        where the compiler and the step share the cores)."""
        enabled = config.compile_ahead
        if enabled is None:
            enabled = runner.placement_platform() != "cpu"
        return cls(builder, config.num_scheduler_steps, config.max_num_seqs) if enabled else None

    def after_dispatch(self, batch: BatchMetadata, scheduler: Any, runner: Any) -> None:
        """``batch`` was just dispatched: ask ``runner`` for the decode programs for 1 to as
        many sequences as ``scheduler`` has unfinished (running and waiting, at most
        ``max_num_seqs``) at ``batch``'s block-table width, largest first."""
        unfinished = min(len(scheduler.running) + len(scheduler.waiting), self.max_num_seqs)
        width = batch.block_tables.shape[1]
        if unfinished <= self._covered.get(width, 0):
            return
        self._covered[width] = unfinished
        builder, steps = self.builder, self.num_steps
        shapes = sorted({(builder.decode_tokens(n), builder.decode_seats(n), width, steps)
                         for n in range(1, unfinished + 1)}, key=lambda shape: -shape[1])
        for shape in shapes:
            if shape not in self.asked and shape[:3] != batch.shape_key:
                self.asked.add(shape)
                runner.prefetch(builder.empty(*shape[:3]), steps)
