"""PenaltyFiller: writes rows of the penalty table through one compiled program.

The penalty table (int32 [max_num_seqs, vocab], ``jaxpage.core.batch.penalty_slots``) lives
on the device with the KV cache; a request's prompt tokens (and the counts a preempted
request had) are written into its row before the step that reads it. Every call writes
``PENALTY_FILL_WIDTH`` tokens (one compiled shape; padding ids are -1 and write nothing),
so a long row takes several calls, the first of which resets the row.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from jaxpage.core.batch.penalty_slots import PenaltyFill
from jaxpage.core.batch.program_set import ProgramKey
from jaxpage.runtime.step import make_penalty_fill

# Tokens per call of the penalty-fill program (one compiled shape; long rows take several).
PENALTY_FILL_WIDTH = 512
PENALTY_FILL_KEY = ProgramKey("penalty_fill", (PENALTY_FILL_WIDTH,))


class PenaltyFiller:
    """Runs the penalty-fill program through ``programs`` (an ``ExecutableCache`` or
    ``JitPrograms``). It holds no table: each method takes the live table (donated) and
    returns the new one, as ``block_ops.BlockMover`` does with the KV cache."""

    def __init__(self, programs, jit: Callable) -> None:
        """``jit``: how the program is jitted (the runner's ``Placement``, the table
        replicated under tensor parallelism)."""
        self.programs = programs
        self.jitted = make_penalty_fill(jit=jit)

    def fill(self, table: jax.Array, fills: list[PenaltyFill]) -> jax.Array:
        """Write ``fills`` into ``table``, in order."""
        width = PENALTY_FILL_WIDTH
        for fill in fills:
            for start in range(0, max(len(fill.token_ids), 1), width):
                ids = np.full(width, -1, np.int32)
                values = np.zeros(width, np.int32)
                chunk = fill.token_ids[start:start + width]
                ids[:len(chunk)] = chunk
                values[:len(chunk)] = fill.values[start:start + width]
                table = self._run(table, fill.slot, ids, values, start == 0)
        return table

    def compile(self, table: jax.Array) -> jax.Array:
        """Build the program by running it once with padding only (it writes nothing)."""
        return self._run(table, 0, np.full(PENALTY_FILL_WIDTH, -1, np.int32),
                         np.zeros(PENALTY_FILL_WIDTH, np.int32), False)

    def spec(self, key: ProgramKey, table: "jax.Array | jax.ShapeDtypeStruct") -> tuple:
        """(key, jitted, args) of the "penalty_fill" program ``key`` names (its bucket:
        the tokens a call), ``table`` as is (``ExecutableCache``'s arguments)."""
        width = key.bucket[0]
        args = ((), table, np.int32(0), np.full(width, -1, np.int32),
                np.zeros(width, np.int32), np.bool_(False))
        return key, self.jitted, args

    def _run(self, table: jax.Array, slot: int, ids: np.ndarray, values: np.ndarray,
             reset: bool) -> jax.Array:
        args = ((), table, np.int32(slot), ids, values, np.bool_(reset))
        program = self.programs.get(PENALTY_FILL_KEY, self.jitted, args)
        table, = program(*args)
        return table
