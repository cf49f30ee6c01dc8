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

from jaxpage.core.sched.step_result import StepResult
from jaxpage.runtime.step_outputs import StepOutputs


@dataclass
class PendingStep:
    """A dispatched single or verify step whose outputs may still be on the device."""

    last_tokens: jax.Array   # int32 [R]  tokens padded, for a step behind it
    outputs: StepOutputs     # tokens and may-stop flags (verify: per token, with emitted);
    #                          the logprob arrays only when some row wants them

    def is_ready(self) -> bool:
        return self.outputs.sampled.is_ready()

    def fetch(self) -> "StepResult":
        """Wait for the step and bring its outputs to the host."""
        return _fetch(self.outputs)


@dataclass
class PendingMultiStep:
    """A dispatched multi-step decode call; ``carry`` stays on the device for chaining."""

    outputs: StepOutputs                    # [K, ...]: tokens int32 [K, S], -1 after a row
    #                                         stops; the logprob arrays when a row wants them
    carry: tuple[jax.Array, jax.Array]      # (last token int32 [R], done bool [R])

    def is_ready(self) -> bool:
        return self.outputs.sampled.is_ready()

    def fetch(self) -> StepResult:
        """Wait for the call: tokens int32 [K, S] and the logprob arrays, each with a
        leading [K] axis."""
        return _fetch(self.outputs)


def _fetch(outputs: StepOutputs) -> StepResult:
    """``outputs`` on the host (waiting for them)."""
    sampled = np.asarray(outputs.sampled)  # one transfer: tokens, may_stop, emitted
    result = StepResult(sampled[0], None, None)
    if sampled.shape[0] > 1:
        result.may_stop = sampled[1]
    if sampled.shape[0] > 2:
        result.emitted = sampled[2]
    if outputs.top_ids is not None:
        result.top_ids, result.top_logprobs, result.token_logprobs, result.token_ranks = (
            np.asarray(array) for array in outputs.logprobs)
    return result
