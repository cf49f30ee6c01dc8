"""Each part of the sampler gives the same result with host-decided ``features`` (what a
GPU runs: the batch's own features) as with the conditionals on the device, including the
reference last step (``reference.sample_rows``, the GPU's). A feature the batch does not
need changes only what no row reads (the log-probabilities of rows that did not ask for
them, the top-k / top-p threshold of greedy rows): more features than the batch needs
are for compiling the largest program (``jaxpage.planning``), not for running batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpage.core.batch.penalty_slots import SEEN
from jaxpage.runtime import sampler
from jaxpage.runtime.step_batch import StepBatch
from jaxpage.core.batch.step_features import ALL_FEATURES, StepFeatures
from pallas_kernels.sampling import reference

S, V = 6, 64


def _batch(rng, *, sampled: bool, sort: bool, penalties: bool, logprobs: bool,
           min_tokens: bool, bias: bool) -> StepBatch:
    temperature = np.where(rng.random(S) < 0.5, 0.8, 0.0) if sampled else np.zeros(S)
    if sampled:
        temperature[0] = 1.1
    return StepBatch.of_rows(**{
        "temperature": jnp.asarray(temperature, jnp.float32),
        "top_k": jnp.asarray([4 if sort else 0] + [0] * (S - 1), jnp.int32),
        "top_p": jnp.asarray([1.0, 0.7 if sort else 1.0] + [1.0] * (S - 2), jnp.float32),
        "min_p": jnp.asarray([0.0, 0.0, 0.05] + [0.0] * (S - 3), jnp.float32),
        "sample_seeds": jnp.asarray(rng.integers(0, 2**32, S, dtype=np.uint32)),
        "sample_index": jnp.asarray(rng.integers(0, 5, S), jnp.int32),
        "min_tokens": jnp.asarray([9 if min_tokens else 0] + [0] * (S - 1), jnp.int32),
        "stop_token_ids": jnp.asarray(rng.integers(-1, V, (S, 3)), jnp.int32),
        "penalty_slot": jnp.asarray([1, -1, 0] + [-1] * (S - 3) if penalties else [-1] * S,
                                    jnp.int32),
        "repetition_penalty": jnp.full(S, 1.3, jnp.float32),
        "frequency_penalty": jnp.full(S, 0.4, jnp.float32),
        "presence_penalty": jnp.full(S, 0.2, jnp.float32),
        "want_logprobs": jnp.asarray([0, 1] + [0] * (S - 2) if logprobs else [0] * S,
                                     jnp.int32),
        # row 0 pushes token 5 up and bans token 6; row 3 boosts token 63; -1: no entry
        "bias_ids": jnp.asarray([[5, 6, -1], [-1] * 3, [-1] * 3, [63, -1, -1], [-1] * 3,
                                 [-1] * 3] if bias else [[-1] * 3] * S, jnp.float32),
        "bias_values": jnp.asarray([[4.0, -100.0, 0], [0] * 3, [0] * 3, [2.5, 0, 0],
                                    [0] * 3, [0] * 3], jnp.float32),
    })


def _run(logits, batch, table, features):
    adjusted = sampler.adjusted_logits(logits, batch, table, features)
    threshold = sampler._cut_threshold(adjusted, batch.temperature, batch.top_k,
                                        batch.top_p, features)
    tokens = reference.sample_rows(adjusted, batch.temperature, threshold, batch.min_p,
                                   batch.sample_seeds, batch.sample_index,
                                   stochastic=None if features is None else features.sampled)
    logprobs = sampler.sampled_logprobs(logits, tokens, batch.want_logprobs, 3, features)
    return adjusted, threshold, tokens, logprobs


@pytest.mark.parametrize("flags", [(0, 0, 0, 0, 0, 0), (1, 0, 0, 0, 0, 0), (1, 1, 0, 1, 0, 0),
                                   (0, 0, 1, 0, 1, 0), (0, 0, 0, 0, 0, 1), (1, 1, 1, 1, 1, 1)])
def test_host_decided_sampler_equals_device_decided(flags):
    rng = np.random.default_rng(sum(f << i for i, f in enumerate(flags)))
    names = ("sampled", "sort", "penalties", "logprobs", "min_tokens", "bias")
    batch = _batch(rng, **dict(zip(names, map(bool, flags))))
    logits = jnp.asarray(rng.standard_normal((S, V)) * 3, jnp.float32)
    table = np.zeros((2, V), np.int32)
    table[0, :5] = SEEN | 2
    table[1, 7] = SEEN
    table = jnp.asarray(table)
    run = jax.jit(_run, static_argnums=3)
    want = run(logits, batch, table, None)
    features = StepFeatures(*map(bool, flags))
    assert (features == ALL_FEATURES) == all(flags)
    got = run(logits, batch, table, features)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0)
    assert want[2].dtype == jnp.int32


def test_reference_last_step_stochastic_flag():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((S, V)), jnp.float32)
    greedy = jnp.zeros(S, jnp.float32)
    args = (jnp.full(S, -jnp.inf), jnp.zeros(S), jnp.arange(S, dtype=jnp.uint32),
            jnp.zeros(S, jnp.int32))
    base = reference.sample_rows(logits, greedy, *args)
    # every row greedy: leaving the noise out (False) or drawing it (True) changes nothing
    for stochastic in (False, True):
        np.testing.assert_array_equal(
            reference.sample_rows(logits, greedy, *args, stochastic=stochastic), base)
    hot = jnp.full(S, 2.0, jnp.float32)
    drawn = reference.sample_rows(logits, hot, *args)
    np.testing.assert_array_equal(reference.sample_rows(logits, hot, *args, stochastic=True),
                                  drawn)
    assert not np.array_equal(np.asarray(drawn), np.asarray(base))  # the noise mattered


def test_logit_bias_adds_to_the_named_tokens_only():
    logits = jnp.zeros((2, 8), jnp.float32)
    ids = jnp.asarray([[3, 5, -1], [-1, -1, -1]], jnp.float32)
    values = jnp.asarray([[2.0, -100.0, 7.0], [9.0, 9.0, 9.0]], jnp.float32)
    got = np.asarray(sampler.add_logit_bias(logits, ids, values))
    want = np.zeros((2, 8), np.float32)
    want[0, 3], want[0, 5] = 2.0, -100.0
    np.testing.assert_array_equal(got, want)


def test_a_row_without_top_k_or_top_p_keeps_every_token_beside_one_that_cuts():
    """The sort runs for the whole batch when one sampled row asks for top-p (and on a GPU
    for every batch the device-decided program runs, ``runtime.step.branch_free``); a
    sampled row with neither top-k nor top-p then keeps its whole vocabulary, even where
    its float32 running sum reaches 1.0 before the tail (a peaked row over a large
    vocabulary), and a greedy row's threshold is never read."""
    vocab = 32768
    logits = np.full((3, vocab), -30.0, np.float32)
    logits[:, 0] = 30.0                                   # one token holds almost all the mass
    logits = jnp.asarray(logits)
    temperature = jnp.asarray([1.0, 1.0, 0.0], jnp.float32)
    top_k = jnp.asarray([0, 0, 0], jnp.int32)
    top_p = jnp.asarray([0.5, 1.0, 1.0], jnp.float32)
    for features in (None, ALL_FEATURES):
        threshold = np.asarray(sampler._cut_threshold(logits, temperature, top_k, top_p,
                                                       features))
        assert threshold[0] == 30.0                       # top-p 0.5 keeps the one token
        assert threshold[1] == -np.inf                    # no cut asked: none made
