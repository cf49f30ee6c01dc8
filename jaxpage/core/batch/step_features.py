"""Which optional parts of sampling a batch needs, decided on the host, for a platform
where a branch inside a program makes the host wait (``branches_wait_for_device``: a GPU).

The step programs skip optional work (the top-k / top-p sort, penalties, log-probabilities,
logit biases, Gumbel noise when every row is greedy) with ``lax.cond`` on a predicate over the batch.
XLA:GPU reads such a predicate back to the host and waits for the stream before it picks
the branch, so the call that launches step n+1 blocks until step n has finished, and the
device then idles while the host does the rest of its work (measured on an H100:
``docs/benchmarks/design_measurements.md``).

There the host decides instead: ``StepFeatures.of(batch)`` reads the same predicates off
the batch's numpy arrays, and a set of features is its own program (``suffix`` names
it). A feature that no row needs is left out of the program; one that some row needs runs
for every row, which is what the conditional's taken branch does: the tokens are the same
either way. The runner runs one such program, ``BASE_FEATURES`` (greedy and plain
sampling, what most batches need), and for any other batch the program that runs any batch
(``features_of``: None), which on a GPU is traced with ``ALL_FEATURES`` (every optional
part for every row, no conditional: ``runtime.step.branch_free``); the planner compiles
``ALL_FEATURES``, the largest. A TPU keeps the conditionals for every batch.

Invariant: a feature is False only when the device's own predicate would be false for
the batch (computed over the same padded arrays, padding rows included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepFeatures:
    """Optional sampling work a program does for every row (False: left out)."""

    sampled: bool     # some row samples (temperature > 0): filters and Gumbel noise
    sort: bool        # some sampled row has top-k or top-p: the sorted threshold
    penalties: bool   # some row has a penalty slot: the penalty table is read
    logprobs: bool    # some row wants log-probabilities: log-softmax and top-k
    min_tokens: bool  # some row is below its min_tokens: its stop ids are suppressed
    bias: bool = False  # some row has a logit_bias: its biases are added to the logits

    @classmethod
    def of(cls, batch: Any) -> "StepFeatures":
        """The features ``batch`` (a ``BatchMetadata``, which imports this module) needs (its
        padded arrays, as the device would see them).
        ``sort`` counts any positive top-k, even one at or above the vocabulary size (the
        sort then keeps every token: the same tokens, some work for nothing)."""
        sampled_rows = batch.temperature > 0                                  # [S]
        return cls(
            sampled=bool(sampled_rows.any()),
            sort=bool((sampled_rows & ((batch.top_k > 0) | (batch.top_p < 1.0))).any()),
            penalties=bool((batch.penalty_slot >= 0).any()),
            logprobs=bool(batch.want_logprobs.any()),
            min_tokens=bool((batch.sample_index < batch.min_tokens).any()),
            bias=bool((batch.bias_ids >= 0).any()))

    def union(self, other: "StepFeatures") -> "StepFeatures":
        """The features either needs."""
        return StepFeatures(*(getattr(self, name) or getattr(other, name) for name in _NAMES))

    @property
    def suffix(self) -> str:
        """The program-name suffix of these features: "" for none, else "+" and the
        names of the features present (e.g. "+sampled+sort")."""
        names = [name for name in _NAMES if getattr(self, name)]
        return "".join("+" + name for name in names)


_NAMES = ("sampled", "sort", "penalties", "logprobs", "min_tokens", "bias")
NO_FEATURES = StepFeatures(False, False, False, False, False, False)
ALL_FEATURES = StepFeatures(True, True, True, True, True, True)
# The one host-decided program a runner runs: the noise of sampled rows (one elementwise
# pass over the logits; greedy rows still take their argmax) and nothing else. Greedy
# batches and the default sampling (temperature 1, no filters) share it, and warm-up and
# compile-ahead build it from empty batches.
BASE_FEATURES = StepFeatures(True, False, False, False, False)


def features_of(batch: Any, static: bool) -> StepFeatures | None:
    """The features of the program that runs ``batch``: ``BASE_FEATURES`` when the host
    decides the branches (``static``) and the batch needs nothing more
    (``BatchMetadata.step_features``), else None: the program that decides on the device,
    which any batch can run. So each bucket has at most two programs (a warm-up of every
    program builds both), not one per feature set."""
    if not static:
        return None
    needs = batch.step_features()
    return BASE_FEATURES if needs.union(BASE_FEATURES) == BASE_FEATURES else None
