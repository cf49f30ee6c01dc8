"""``StepResult``: one device call's results on the host, what ``Scheduler.apply`` takes.

The device's ``runtime.step_outputs.StepOutputs`` after the transfer: numpy arrays, no
JAX. Which kind of call it came from follows from its fields:

* a single step: ``tokens`` int32 [S] and ``may_stop`` int32 [S] (a superset of the rows
  whose token stops their request; None: every row is checked);
* a multi-step decode call: ``tokens`` int32 [K, S], -1 after a row stopped, no flags;
* a verify step: ``tokens`` and ``emitted`` int32 [T], one per batch token (1: emitted;
  each row's emitted tokens are a prefix of its tokens, ``cu_q_lens`` says where rows
  start).

The log-probability arrays are all present or all None (no row asked), with the same
leading axes as ``tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class StepResult:
    tokens: np.ndarray                        # int32 [S] ([K, S] multi-step; [T] verify)
    top_ids: np.ndarray | None = None         # int32 [S, N] when some row asked for logprobs
    top_logprobs: np.ndarray | None = None    # float32 [S, N]
    token_logprobs: np.ndarray | None = None  # float32 [S]  logprob of the sampled token
    token_ranks: np.ndarray | None = None     # int32 [S]  its 1-based rank in the vocabulary
    may_stop: np.ndarray | None = None        # int32 [S]  single steps: step.may_stop's flags
    emitted: np.ndarray | None = None         # int32 [T]  verify steps: the tokens emitted

    @classmethod
    def verified(cls, rows: list[list[int]], sizes: list[int]) -> tuple["StepResult", np.ndarray]:
        """A verify step's result, and its ``cu_q_lens`` int32 [S + 1], from each row's
        emitted tokens (``rows[i]``, at most ``sizes[i]``, the row's scheduled tokens):
        the rest of a row are not emitted."""
        cu_q_lens = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
        tokens = np.zeros(int(cu_q_lens[-1]), np.int32)
        emitted = np.zeros(int(cu_q_lens[-1]), np.int32)
        for row, emitted_tokens in enumerate(rows):
            start = int(cu_q_lens[row])
            tokens[start:start + len(emitted_tokens)] = emitted_tokens
            emitted[start:start + len(emitted_tokens)] = 1
        return cls(tokens, emitted=emitted), cu_q_lens
