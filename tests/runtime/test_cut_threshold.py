"""The top-k / top-p cut (``jaxpage.runtime.cut_threshold``): the bisection gives the
sorted rule's cut, bit for bit, on rows with ties, ruled-out tokens and every kind of
k / top_p / temperature, and both give the hand-worked cuts of small rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpage.runtime.cut_threshold import (METHODS, cut_method, cut_threshold, key_values,
                                           order_keys)

INF = np.inf


def _cut(method: str, logits, temperature, top_k, top_p) -> np.ndarray:
    run = jax.jit(lambda *a: cut_threshold(*a, method=method))
    return np.asarray(run(jnp.asarray(logits, jnp.float32), jnp.asarray(temperature, jnp.float32),
                          jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32)))


def test_keys_keep_the_order_of_the_floats_and_give_them_back():
    # normal floats only: XLA:CPU flushes subnormals to zero
    values = np.array([-INF, -3e38, -1.5, -1e-30, 0.0, 1e-30, 0.5, 1.0, 2.0, 3e38, INF],
                      np.float32)
    keys = np.asarray(order_keys(jnp.asarray(values)))
    assert np.all(np.diff(keys.astype(np.int64)) > 0)
    np.testing.assert_array_equal(np.asarray(key_values(jnp.asarray(keys))), values)
    negative_zero = np.asarray(order_keys(jnp.asarray([-0.0, 0.0], jnp.float32)))
    assert negative_zero[0] == negative_zero[1]  # one key: the floats are equal


@pytest.mark.parametrize("method", METHODS)
def test_hand_worked_cuts(method):
    rows = [  # (logits, temperature, top_k, top_p, cut)
        ([3.0, 2.0, 1.0, 0.0], 1.0, 2, 1.0, 2.0),                 # top-k 2
        ([3.0, 2.0, 1.0, 0.0], 1.0, 1, 1.0, 3.0),                 # top-k 1: the maximum
        ([5.0, 1.0, 5.0, 5.0], 1.0, 2, 1.0, 5.0),                 # a tie at the k-th rank
        ([0.0, 0.0, 0.0, 0.0], 1.0, 0, 0.6, 0.0),                 # all tied: all kept
        ([1.0, 0.0, 0.0, 0.0], 1.0, 0, 1e-6, 1.0),                # the top token always
        # probabilities 0.5, 0.25, 0.125, 0.125: mass above rank 2 is 0.75
        ([np.log(4), np.log(2), 0.0, 0.0], 1.0, 0, 0.74, np.log(2)),
        ([np.log(4), np.log(2), 0.0, 0.0], 1.0, 0, 0.76, 0.0),
        # temperature 2 flattens it: weights 2, 1.41, 1, 1 -> 0.37, 0.26, 0.18, 0.18; the
        # mass above the third rank is 0.63
        ([np.log(4), np.log(2), 0.0, 0.0], 2.0, 0, 0.6, np.log(2)),
        ([np.log(4), np.log(2), 0.0, 0.0], 2.0, 0, 0.66, 0.0),
        # top-k 2 renormalises over its two: 2/3, 1/3; top_p 0.6 keeps only the first
        ([np.log(4), np.log(2), 0.0, 0.0], 1.0, 2, 0.6, np.log(4)),
        ([1.0, -INF, -INF, -INF], 1.0, 2, 1.0, -INF),             # k past the allowed tokens
        ([1.0, 0.0, -INF, -INF], 1.0, 0, 0.9999, 0.0),            # top-p never keeps -inf
        ([2.0, 1.0, 0.0, -1.0], 0.0, 1, 0.1, -INF),               # greedy: no cut
        ([2.0, 1.0, 0.0, -1.0], 1.0, 0, 1.0, -INF),               # nothing asked: no cut
        ([2.0, 1.0, 0.0, -1.0], 1.0, 4, 1.0, -INF),               # k = V cuts nothing
    ]
    logits, temperature, top_k, top_p, want = (np.array(c) for c in zip(*rows))
    got = _cut(method, logits.astype(np.float32), temperature, top_k, top_p)
    np.testing.assert_array_equal(got, want.astype(np.float32))


def test_top_p_of_one_keeps_every_top_k_token_of_a_peaked_row():
    """top_p = 1 asks for no top-p cut: a row whose float32 mass reaches 1.0 within its top
    k (one token holding nearly all of it) still keeps all k."""
    logits = np.full((1, 4096), -30.0, np.float32)
    logits[0, 0], logits[0, 1:100] = 30.0, np.linspace(-1, -20, 99)
    for method in METHODS:
        got = _cut(method, logits, [1.0], [100], [1.0])
        assert got[0] == np.float32(-20.0), method


@pytest.mark.parametrize("vocab,scale,integer", [
    (50, 1.0, False), (50, 1.0, True), (1000, 3.0, False), (1000, 1.0, True),
    (49152, 1.0, False), (49152, 8.0, True)])
def test_bisection_equals_the_sort_on_random_rows(vocab, scale, integer):
    """Random rows (rounded to halves: many ties), 5% of tokens ruled out (-inf), every
    kind of k, top_p and temperature (greedy rows included): the same cut, bit for bit."""
    rng = np.random.default_rng(vocab + int(scale) + integer)
    rows = 48 if vocab < 10_000 else 12
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * scale
    if integer:
        logits = np.round(logits * 2).astype(np.float32) / 2
    logits[rng.random((rows, vocab)) < 0.05] = -INF
    temperature = rng.choice([0.0, 0.3, 1.0, 1.7], rows)
    top_k = rng.choice([-1, 0, 1, 2, 7, vocab // 3, vocab - 1, vocab, vocab + 5], rows)
    top_p = rng.choice([1.0, 0.99, 0.9, 0.5, 0.1, 1e-6], rows)
    sort = _cut("sort", logits, temperature, top_k, top_p)
    bisect = _cut("bisect", logits, temperature, top_k, top_p)
    np.testing.assert_array_equal(bisect, sort)
    assert np.isfinite(sort).sum() >= rows // 3  # most rows were cut somewhere


def test_an_unknown_method_is_a_value_error():
    with pytest.raises(ValueError, match="'heap'"):
        cut_threshold(jnp.zeros((1, 4)), jnp.ones(1), jnp.ones(1, jnp.int32), jnp.ones(1),
                      method="heap")


def test_each_platform_cuts_by_its_method():
    """The bisection on the CPU (timed faster there), the sort on GPUs and TPUs (the
    bisection is not timed there)."""
    assert [cut_method(p) for p in ("cpu", "tpu", "gpu", "cuda")] == [
        "bisect", "sort", "sort", "sort"]
