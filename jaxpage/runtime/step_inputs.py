"""``StepInputs``: a single step's device inputs beyond its batch (``ModelRunner.dispatch``).

Invariants: a "verify" step may take a draft model's distributions (``draft_probs`` with
``q_src``, given together) and never a grammar mask; a "step" may take a grammar mask and
never draft distributions. The arrays are the batch's own size; the runner pads them when
the batch runs padded in a larger program (padded rows allow every token, padded tokens
propose from no draft row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class StepInputs:
    """Extra inputs of one step (see the module docstring)."""

    token_mask: np.ndarray | None = None  # int32 [S, ceil(V / 32)]  packed grammar masks
    draft_probs: Any = None               # float32 [Q, V] on the device: draft distributions
    q_src: np.ndarray | None = None       # int32 [T]  the draft_probs row of each token's
    #                                       next proposal, -1: a point-mass proposal

    @classmethod
    def of(cls, token_mask: np.ndarray | None = None,
           draft: "tuple[Any, np.ndarray] | None" = None) -> "StepInputs | None":
        """From a step's grammar masks (or None) and a draft model's ``(draft_probs,
        q_src)`` (or None); None when there is neither (a plain step's)."""
        if token_mask is None and draft is None:
            return None
        draft_probs, q_src = draft if draft is not None else (None, None)
        return cls(token_mask, draft_probs, q_src)

    def check(self, kind: str, num_rows: int, mask_words: int) -> None:
        """A ValueError unless these inputs fit a ``kind`` step of ``num_rows`` rows whose
        masks have ``mask_words`` words."""
        if (self.draft_probs is None) != (self.q_src is None):
            raise ValueError("draft_probs and q_src go together")
        if kind == "verify" and self.token_mask is not None:
            raise ValueError("a verify step takes no grammar mask")
        if kind != "verify" and self.draft_probs is not None:
            raise ValueError(f"a {kind!r} takes no draft distributions")
        mask = self.token_mask
        if mask is not None and (mask.shape != (num_rows, mask_words) or mask.dtype != np.int32):
            raise ValueError(f"token_mask has shape {mask.shape} ({mask.dtype}); expected "
                             f"int32 {(num_rows, mask_words)}")
