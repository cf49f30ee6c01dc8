"""The GPU attention kernel's split merge (``split_merge.merge_splits``) against XLA's
``combine_splits``: the same rows, padding tokens' rows zero whatever their partials
hold, rows that saw no key zero, any row count (its programs' block the largest power of
two up to 16 that divides it)."""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.split_merge import block_rows_for, merge_splits
from pallas_kernels.ragged_paged_attention.tiling import MASK_VALUE, combine_splits
from tests.kernels.mode import INTERPRET


def partials(rng, splits: int, rows: int, head_dim: int, tail: int):
    """Partials as the attention kernel leaves them: each split's base-2 row max, row sum
    (>= 1 where it saw a key: the max's own term) and unnormalized sums; split 1 saw no
    key for every third row, no split saw one for row 2, and the last ``tail`` rows
    (a padding token's, never written) hold what an earlier call left: plausible partials,
    and in the first of them NaN and infinities."""
    m = rng.normal(0, 4, (splits, rows)).astype(np.float32)
    l = (1 + rng.random((splits, rows)) * 20).astype(np.float32)
    acc = (rng.normal(0, 1, (splits, rows, head_dim)) * l[..., None]).astype(np.float32)
    empty = np.zeros((splits, rows), bool)
    empty[1, ::3] = True
    empty[:, 2] = True
    m[empty], l[empty], acc[empty] = MASK_VALUE, 0.0, 0.0
    m[:, rows - tail], l[:, rows - tail] = np.nan, np.inf
    acc[:, rows - tail] = np.nan
    return acc, m, l


def token_counts(real_tokens: int):
    """``cu_q_lens`` / ``num_seqs`` of two real sequences holding ``real_tokens`` tokens,
    then a padding slot whose offsets run on (``num_seqs`` says where they stop)."""
    first = real_tokens // 2
    return (jnp.asarray([0, first, real_tokens, real_tokens + 7], jnp.int32),
            jnp.asarray([2], jnp.int32))


@pytest.mark.parametrize("splits,rows,extra,q_heads", [(3, 48, 16, 4), (2, 42, 16, 2),
                                                       (7, 35, 0, 5)])
def test_merge_equals_xla_and_zeroes_padding(splits, rows, extra, q_heads):
    rng = np.random.default_rng(splits * 100 + rows)
    acc, m, l = partials(rng, splits, rows + extra, head_dim=32, tail=q_heads + extra)
    valid = rows - q_heads  # the last token is padding
    cu_q_lens, num_seqs = token_counts(valid // q_heads)
    got = np.asarray(merge_splits(jnp.asarray(acc), jnp.asarray(m), jnp.asarray(l),
                                  cu_q_lens, num_seqs, num_rows=rows, q_heads=q_heads,
                                  dtype=jnp.float32, interpret=INTERPRET))
    want = np.asarray(combine_splits(jnp.asarray(acc), jnp.asarray(m), jnp.asarray(l),
                                     log2=True))[:rows]
    assert got.shape == (rows, 32)
    np.testing.assert_allclose(got[:valid], want[:valid], rtol=2e-5, atol=1e-6)
    assert (got[valid:] == 0).all() and np.isfinite(got).all()
    assert (got[2] == 0).all()                       # no split saw a key
    assert not (got[3] == 0).all()                   # split 1 empty there, the others not
    bf16 = merge_splits(jnp.asarray(acc), jnp.asarray(m), jnp.asarray(l), cu_q_lens,
                        num_seqs, num_rows=rows, q_heads=q_heads, dtype=jnp.bfloat16,
                        interpret=INTERPRET)
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(bf16, np.float32), got, rtol=1e-2, atol=1e-2)


def test_block_rows_divide_the_rows():
    assert [block_rows_for(n) for n in (512, 48, 42, 35, 8, 96)] == [16, 16, 2, 1, 8, 16]
