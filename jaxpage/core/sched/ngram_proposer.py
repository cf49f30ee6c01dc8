"""Prompt-lookup (n-gram) proposals for speculative decoding, on the host.

The first brick of issue [10]: not yet wired into the engine (the verification step, the
rejection sampler and the KV roll-back come next).

A sequence that quotes its input (a rewrite, an edit, an extraction) often continues the
way an earlier passage did. ``propose_ngram`` looks for the sequence's last ``n`` tokens
earlier in the sequence, for ``n`` from ``max_n`` down to ``min_n`` (the longest suffix that
recurs wins), and proposes the up to ``k`` tokens that followed its first occurrence; they
may run into the suffix itself, as vLLM's proposer does (``[1, 2, 3, 4, 2, 3]`` with
``n = 2`` proposes ``[4, 2, 3]``). No occurrence: no proposal (an empty array), so the
target model verifies nothing for that sequence.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray | list[int], k: int, min_n: int,
                  max_n: int) -> np.ndarray:
    """int32 [<= k]: the tokens that followed the first earlier occurrence of the longest
    suffix of ``tokens`` (length ``min_n``..``max_n``) that occurs earlier; [] if none.

    ``tokens``: the sequence so far (prompt and output), int [L].
    """
    if k < 1 or min_n < 1 or max_n < min_n:
        raise ValueError(f"need k >= 1 and 1 <= min_n <= max_n, got k={k}, "
                         f"min_n={min_n}, max_n={max_n}")
    seq = np.asarray(tokens, dtype=np.int64)                                    # [L]
    length = seq.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows starting at 0 .. L-n-1: each has at least one token after it, so the
        # suffix itself (starting at L-n) is never its own match.
        windows = np.lib.stride_tricks.sliding_window_view(seq[:length - 1], n)  # [L-n, n]
        hits = np.flatnonzero((windows == seq[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return seq[start:start + k].astype(np.int32)
    return np.zeros(0, np.int32)
