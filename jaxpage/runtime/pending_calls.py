"""Handles of dispatched device calls (``ModelRunner.dispatch`` / ``dispatch_multi_step``)
and their results on the host.

A handle's arrays may still be computing on the device: ``is_ready`` asks without
waiting, ``fetch`` waits and copies to the host. A multi-step call's ``carry`` stays on
the device, where the next call chained behind it reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np


@dataclass
class PendingStep:
    """A dispatched single step whose outputs may still be on the device."""

    last_tokens: jax.Array                  # int32 [R]  tokens padded, for a step behind it
    sampled: jax.Array                      # int32 [2, S]  tokens; may-stop flags (step.may_stop)
    top_ids: jax.Array | None = None        # int32 [S, K] (only when a row wants logprobs)
    top_logprobs: jax.Array | None = None   # float32 [S, K]
    token_logprobs: jax.Array | None = None  # float32 [S]  (likewise)
    token_ranks: jax.Array | None = None     # int32 [S]

    def is_ready(self) -> bool:
        return self.sampled.is_ready()

    def fetch(self) -> "StepResult":
        """Wait for the step and bring its outputs to the host."""
        sampled = np.asarray(self.sampled)
        result = _fetch(sampled[0], self.top_ids, self.top_logprobs, self.token_logprobs,
                        self.token_ranks)
        result.may_stop = sampled[1]
        if sampled.shape[0] > 2:  # a verify step: per token, with its emitted flags
            result.emitted = sampled[2]
        return result


@dataclass
class PendingMultiStep:
    """A dispatched multi-step decode call; ``carry`` stays on the device for chaining."""

    tokens: jax.Array                       # int32 [K, S], -1 after a row stops
    carry: tuple[jax.Array, jax.Array]      # (last token int32 [R], done bool [R])
    # (top_ids [K, S, N], top_logprobs [K, S, N], token_logprobs [K, S], token_ranks [K, S])
    # when some row wants logprobs, else None
    logprobs: tuple[jax.Array, ...] | None = None

    def is_ready(self) -> bool:
        return self.tokens.is_ready()

    def fetch(self) -> np.ndarray:
        """Tokens int32 [K, S] on the host (see ``fetch_result`` for the logprobs too)."""
        return np.asarray(self.tokens)

    def fetch_result(self) -> "StepResult":
        """Tokens and logprob arrays, each with a leading [K] axis."""
        return _fetch(self.tokens, *(self.logprobs or (None,) * 4))


@dataclass
class StepResult:
    """One device call's results on the host; multi-step calls add a leading [K] axis."""

    tokens: np.ndarray                      # int32 [S] sampled token per sequence
    top_ids: np.ndarray | None              # int32 [S, K] when some row asked for logprobs
    top_logprobs: np.ndarray | None         # float32 [S, K]
    token_logprobs: np.ndarray | None = None  # float32 [S]  logprob of the sampled token
    token_ranks: np.ndarray | None = None     # int32 [S]  its 1-based rank in the vocabulary
    may_stop: np.ndarray | None = None        # int32 [S]  single steps: step.may_stop's flags
    emitted: np.ndarray | None = None         # int32 [T]  verify steps: the tokens emitted


def _fetch(tokens, top_ids, top_logprobs, token_logprobs, token_ranks) -> StepResult:
    if top_ids is None:
        return StepResult(np.asarray(tokens), None, None)
    return StepResult(np.asarray(tokens), np.asarray(top_ids), np.asarray(top_logprobs),
                      np.asarray(token_logprobs), np.asarray(token_ranks))
