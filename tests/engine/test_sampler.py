"""The device sampler's filters, checked on hand-made logits."""

import jax.numpy as jnp
import numpy as np

from jaxpage.runtime.sampler import sample


def batch_for(rows, **overrides):
    fields = dict(temperature=np.ones(rows, np.float32), top_k=np.full(rows, -1, np.int32),
                  top_p=np.ones(rows, np.float32), min_p=np.zeros(rows, np.float32),
                  sample_seeds=np.arange(rows, dtype=np.uint32),
                  sample_index=np.zeros(rows, np.int32),
                  stop_token_ids=np.full((rows, 4), -1, np.int32),
                  min_tokens=np.zeros(rows, np.int32))
    fields.update(overrides)
    return {k: jnp.asarray(v) for k, v in fields.items()}


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
