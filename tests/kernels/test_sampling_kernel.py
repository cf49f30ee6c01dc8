"""The CPU sampling kernel (``pallas_kernels.sampling``, C++) against its jnp reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import sampling
from pallas_kernels.sampling import cpu, reference

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler here")


def rows(rng, s, v):
    logits = (rng.standard_normal((s, v)) * 3).astype(np.float32)
    logits[0, :7] = -np.inf                     # masked tokens
    if s > 2:
        logits[2] = -np.inf                     # a row with every token masked
    temperature = rng.choice([0.0, 0.3, 1.0, 1.7], s).astype(np.float32)
    threshold = np.where(rng.random(s) < 0.3, 1.5, -np.inf).astype(np.float32)
    min_p = np.where(rng.random(s) < 0.3, 0.05, 0.0).astype(np.float32)
    seeds = rng.integers(0, 2 ** 32, s, dtype=np.uint32)
    index = rng.integers(0, 1000, s).astype(np.int32)
    return tuple(jnp.asarray(x) for x in (logits, temperature, threshold, min_p, seeds, index))


@pytest.mark.parametrize("s,v", [(1, 49152), (9, 1000), (33, 4099), (4, 17), (3, 5)])
def test_kernel_tokens_equal_the_reference(s, v):
    rng = np.random.default_rng(s * 7 + v)
    args = rows(rng, s, v)
    ref = jax.jit(lambda *a: sampling.sample_rows(*a, backend="reference"))(*args)
    got = jax.jit(lambda *a: sampling.sample_rows(*a, backend="cpu"))(*args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    if s > 2:
        assert int(got[2]) == 0                 # nothing allowed: token 0, as the reference


def test_many_draws_agree_and_follow_the_distribution():
    """Over 4,000 seeded draws from one distribution the kernel picks the reference's
    token every time, and the counts match the probabilities."""
    probs = np.array([0.4, 0.25, 0.2, 0.1, 0.05] + [0.0] * 11, np.float32)
    with np.errstate(divide="ignore"):
        logits = jnp.asarray(np.tile(np.log(probs), (4000, 1)))
    args = (logits, jnp.ones(4000), jnp.full(4000, -jnp.inf), jnp.zeros(4000),
            jnp.arange(4000, dtype=jnp.uint32), jnp.full(4000, 3, jnp.int32))
    got = np.asarray(sampling.sample_rows(*args, backend="cpu"))
    np.testing.assert_array_equal(got, np.asarray(sampling.sample_rows(*args, backend="reference")))
    np.testing.assert_allclose(np.bincount(got, minlength=16) / 4000, probs, atol=0.025)


def test_a_row_draws_the_same_alone_and_in_a_batch():
    rng = np.random.default_rng(3)
    args = rows(rng, 16, 3000)
    batch = np.asarray(sampling.sample_rows(*args, backend="cpu"))
    for i in (1, 5, 11):
        alone = sampling.sample_rows(*(x[i:i + 1] for x in args), backend="cpu")
        assert int(alone[0]) == batch[i]


def test_gumbel_argmax_equals_jnp_argmax_on_large_rows():
    rng = np.random.default_rng(4)
    logits = jnp.asarray(rng.standard_normal((8, 49152)).astype(np.float32))
    seeds, index = jnp.arange(8, dtype=jnp.uint32), jnp.arange(8, dtype=jnp.int32)
    noisy = logits + reference.gumbel_noise(seeds, index, 49152)
    got = sampling.sample_rows(logits, jnp.ones(8), jnp.full(8, -jnp.inf), jnp.zeros(8), seeds,
                               index, backend="cpu")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(noisy, axis=-1)))


def test_bad_shapes_and_backends_are_refused():
    args = rows(np.random.default_rng(5), 4, 32)
    with pytest.raises(ValueError, match="temperature must be"):
        sampling.sample_rows(args[0], args[1][:3], *args[2:])
    with pytest.raises(ValueError, match="logits must be"):
        sampling.sample_rows(args[0][0], *args[1:])
    with pytest.raises(ValueError, match="backend="):
        sampling.sample_rows(*args, backend="tpu")
