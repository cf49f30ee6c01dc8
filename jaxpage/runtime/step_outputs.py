"""``StepOutputs``: what every model program returns besides its caches and carry.

The single step, the verify step and the multi-step decode loop return one type, its
fields in one order; ``sampler.sampled_logprobs`` returns the log-probability arrays in
the same order as the fields here (``LOGPROB_FIELDS``). A registered pytree: a None field
is no array at all (no output buffer, nothing to copy).

Invariants: ``sampled`` is always set and stacks the int32 outputs one per row of its
leading axis, so that they cross to the host in one transfer: row 0 the tokens, row 1 the
``may_stop`` flags (single and verify steps; the decode loop checks stops itself and has
no row 1), row 2 the ``emitted`` flags (verify steps only). The four log-probability
fields are all set or all None (the runner drops them when no row wants
log-probabilities). Shapes are per row [S] in a single step, per token [T] in a verify
step, and carry a leading [K] axis in a decode loop of K iterations; N is
``MAX_TOP_LOGPROBS``.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

LOGPROB_FIELDS = ("top_ids", "top_logprobs", "token_logprobs", "token_ranks")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepOutputs:
    """One program's sampled tokens and what comes with them (see the module docstring)."""

    # int32 [2, S] (tokens; may_stop: 1 where the token could end its request), [3, T] in a
    # verify step (+ emitted: 1 where the token is emitted), [1, K, S] in a decode loop
    # (tokens, -1 after a row stopped)
    sampled: jax.Array
    top_ids: jax.Array | None = None        # int32 [S, N]
    top_logprobs: jax.Array | None = None   # float32 [S, N]
    token_logprobs: jax.Array | None = None  # float32 [S]  logprob of the sampled token
    token_ranks: jax.Array | None = None     # int32 [S]  its 1-based rank in the vocabulary

    @classmethod
    def of(cls, tokens: jax.Array, may_stop: jax.Array | None = None,
           emitted: jax.Array | None = None, *logprobs: jax.Array) -> "StepOutputs":
        """Outputs from their parts (``sampled`` stacked from the int rows present)."""
        rows = [a for a in (tokens, may_stop, emitted) if a is not None]
        return cls(jax.numpy.stack(rows), *logprobs)

    @property
    def logprobs(self) -> tuple[jax.Array | None, ...]:
        """The log-probability fields, in ``LOGPROB_FIELDS`` order."""
        return self.top_ids, self.top_logprobs, self.token_logprobs, self.token_ranks

    def without_logprobs(self) -> "StepOutputs":
        """The same outputs with no log-probability arrays (no row wanted them)."""
        return StepOutputs(self.sampled)

    def arrays(self) -> list[jax.Array]:
        """Every array present, ``sampled`` first."""
        return [a for a in (self.sampled, *self.logprobs) if a is not None]
