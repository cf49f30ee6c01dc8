"""The device's acceptance rule for speculative proposals (``step.verify_tokens``)."""

import jax.numpy as jnp
import numpy as np

from jaxpage.runtime.step import verify_tokens


def emitted(tokens, input_ids, row_lens, T):
    cu = np.concatenate([[0], np.cumsum(row_lens)]).astype(np.int32)
    S = len(row_lens)
    padded = lambda values: np.pad(np.asarray(values, np.int32), (0, T - len(values)))  # noqa: E731
    index = np.arange(T)
    token_row = np.clip(np.searchsorted(cu[1:], index, side="right"), 0, S - 1)
    return np.asarray(verify_tokens(jnp.asarray(padded(tokens)), jnp.asarray(padded(input_ids)),
                                    jnp.asarray(cu), jnp.asarray(token_row, jnp.int32))).tolist()


def test_rows_emit_up_to_their_first_disagreement():
    # row 0: last token 5, proposals 6 7 8; the target says 6 7 9 (.): accepts 6, 7; then 9
    # row 1: last token 1, no proposal: one token
    # row 2: last token 3, proposals 4 4; the target says 4 4 2: all accepted, bonus 2
    # row 3: last token 8, proposal 1; the target says 2: rejected, correction 2
    input_ids = [5, 6, 7, 8, 1, 3, 4, 4, 8, 1]
    tokens = [6, 7, 9, 0, 11, 4, 4, 2, 2, 5]
    got = emitted(tokens, input_ids, [4, 1, 3, 2], T=16)
    assert got == [1, 1, 1, 0, 1, 1, 1, 1, 1, 0] + [0] * 6


def test_a_later_match_after_a_rejection_is_not_emitted():
    # proposals 6 7 8; the target says 9 7 8 x: only the correction 9
    got = emitted([9, 7, 8, 3], [5, 6, 7, 8], [4], T=4)
    assert got == [1, 0, 0, 0]
