"""The device sampler's filters, checked on hand-made logits."""

import jax.numpy as jnp
import numpy as np

from jaxpage.runtime.sampler import sample
from jaxpage.runtime.step_batch import StepBatch


def batch_for(rows, **overrides):
    fields = dict(temperature=np.ones(rows, np.float32), top_k=np.full(rows, -1, np.int32),
                  top_p=np.ones(rows, np.float32), min_p=np.zeros(rows, np.float32),
                  sample_seeds=np.arange(rows, dtype=np.uint32),
                  sample_index=np.zeros(rows, np.int32),
                  stop_token_ids=np.full((rows, 4), -1, np.int32),
                  min_tokens=np.zeros(rows, np.int32))
    fields.update(overrides)
    return StepBatch.of_rows(**fields)


LOGITS = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))


def draws(n=400, **overrides):
    logits = jnp.asarray(np.tile(LOGITS, (n, 1)))
    return np.asarray(sample(logits, batch_for(n, **overrides)))


def test_unfiltered_sampling_follows_the_distribution():
    counts = np.bincount(draws(2000), minlength=4) / 2000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.04)


def test_top_k_top_p_min_p_restrict_the_support():
    assert set(draws(top_k=np.full(400, 2, np.int32))) == {0, 1}
    assert set(draws(top_p=np.full(400, 0.7, np.float32))) == {0, 1}  # 0.5 + 0.3 covers 0.7
    assert set(draws(top_p=np.full(400, 0.5, np.float32))) == {0}
    assert set(draws(min_p=np.full(400, 0.35, np.float32))) == {0, 1}  # >= 0.35 * 0.5


def test_greedy_rows_and_suppressed_tokens():
    n = 8
    temps = np.array([0, 1, 0, 1, 0, 1, 0, 1], np.float32)
    stop_ids = np.full((n, 4), -1, np.int32)
    stop_ids[2:6, 0] = 0
    min_tokens = np.array([0, 0, 1, 1, 0, 0, 0, 0], np.int32)  # rows 2, 3: too early to stop
    out = draws(n, temperature=temps, stop_token_ids=stop_ids, min_tokens=min_tokens)
    assert out[0] == 0 and out[2] == 1  # greedy, with token 0 masked in row 2
    assert out[4] == 0  # row 4 lists token 0 as a stop token but is past min_tokens
    assert out[3] != 0


def test_first_argmax_is_argmax_with_ties_and_masked_rows():
    from jaxpage.runtime.sampler import first_argmax

    rng = np.random.default_rng(0)
    values = rng.integers(0, 4, (64, 37)).astype(np.float32)  # many ties
    values[3] = -np.inf                                         # a fully masked row
    values[5, 10:] = -np.inf
    np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(values))),
                                  values.argmax(axis=-1))


def test_gumbel_noise_depends_on_seed_index_and_token_only():
    from jaxpage.runtime.sampler import gumbel_noise

    seeds = np.array([7, 7, 8, 7], np.uint32)
    index = np.array([0, 1, 0, 0], np.int32)
    noise = np.asarray(gumbel_noise(jnp.asarray(seeds), jnp.asarray(index), 4096))  # [4, V]
    np.testing.assert_array_equal(noise[0], noise[3])        # same draw, another row
    alone = np.asarray(gumbel_noise(jnp.asarray(seeds[2:3]), jnp.asarray(index[2:3]), 4096))
    np.testing.assert_array_equal(alone[0], noise[2])         # same draw, another batch
    assert not np.array_equal(noise[0], noise[1]) and not np.array_equal(noise[0], noise[2])
    # Standard Gumbel: mean = Euler's gamma, variance = pi^2 / 6, over 4 x 4096 draws.
    assert abs(noise.mean() - 0.5772) < 0.03 and abs(noise.var() - np.pi ** 2 / 6) < 0.1
    # Neighbouring token ids are not correlated.
    assert abs(np.corrcoef(noise[0, :-1], noise[0, 1:])[0, 1]) < 0.05


def test_skipping_the_sort_keeps_every_token_of_unfiltered_rows():
    """Rows without top-k / top-p keep their whole distribution (min-p alone included)
    whether or not another row of the batch makes the sampler sort."""
    from jaxpage.runtime.sampler import _filtered_logits

    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((3, 64)).astype(np.float32))
    temperature = jnp.asarray([1.0, 0.7, 1.0], jnp.float32)
    min_p = jnp.asarray([0.0, 0.0, 0.2], jnp.float32)
    alone = _filtered_logits(logits, temperature, jnp.zeros(3, jnp.int32),
                             jnp.ones(3, jnp.float32), min_p)
    sorted_too = _filtered_logits(jnp.concatenate([logits, logits[:1]]),
                                  jnp.concatenate([temperature, temperature[:1]]),
                                  jnp.asarray([0, 0, 0, 5], jnp.int32),
                                  jnp.ones(4, jnp.float32), jnp.concatenate([min_p, min_p[:1]]))
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(sorted_too)[:3])
    assert np.isfinite(np.asarray(alone)[:2]).all()             # nothing dropped
    assert np.isinf(np.asarray(sorted_too)[3]).sum() == 64 - 5  # top-k 5 kept 5
