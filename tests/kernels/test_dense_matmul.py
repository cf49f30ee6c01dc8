"""The CPU dense-matmul kernel (``pallas_kernels.dense_matmul``, C++) and its dispatch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dense_matmul as dm
from pallas_kernels.dense_matmul import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler here")


@pytest.mark.parametrize("m,k,n", [(1, 37, 100), (5, 64, 64), (24, 576, 192), (31, 100, 130),
                                   (70, 48, 1000), (130, 17, 65)])
def test_kernel_matches_float64(m, k, n):
    rng = np.random.default_rng(m + k + n)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32)
    got = np.asarray(dm.dense_matmul(jnp.asarray(x), jnp.asarray(w), backend="cpu"))
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.sqrt(k))


def test_a_row_is_the_same_alone_and_in_any_batch():
    """Each output is one chain of FMAs over K in order: bit-identical whatever M is."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((64, 576), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((576, 200), dtype=np.float32))
    full = np.asarray(dm.dense_matmul(x, w, backend="cpu"))
    for rows in (slice(0, 1), slice(7, 31), slice(40, 64)):
        np.testing.assert_array_equal(np.asarray(dm.dense_matmul(x[rows], w, backend="cpu")),
                                      full[rows])


def test_auto_takes_the_kernel_for_float32_on_the_cpu_at_any_row_count():
    w = jnp.ones((64, 32), jnp.float32)

    def lowered(rows, dtype=jnp.float32):
        x = jnp.ones((rows, 64), dtype)
        return jax.jit(lambda x, w: dm.dense_matmul(x, w)).lower(x, w.astype(dtype)).as_text()

    for rows in (1, 8, 24, 512):
        assert "jaxpage_dense_matmul_f32" in lowered(rows)
    assert "jaxpage_dense_matmul_f32" not in lowered(64, jnp.bfloat16)
    # leading dimensions are rows: [2, 16, K] is 32 rows
    x3 = jnp.ones((2, 16, 64), jnp.float32)
    out = jax.jit(lambda x, w: dm.dense_matmul(x, w))(x3, w)
    assert out.shape == (2, 16, 32) and float(out[1, 15, 31]) == 64.0


def test_bad_shapes_and_backends_are_refused():
    x, w = jnp.ones((4, 8)), jnp.ones((8, 3))
    with pytest.raises(ValueError, match="must be"):
        dm.dense_matmul(x, jnp.ones((7, 3)))
    with pytest.raises(ValueError, match="backend="):
        dm.dense_matmul(x, w, backend="tpu")
    with pytest.raises(ValueError, match="float32"):
        dm.dense_matmul(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), backend="cpu")


@pytest.mark.skipif(not cpu.available(), reason="no C++ compiler")
@pytest.mark.parametrize("live", [0, 1, 7, 13, 40])
def test_rows_past_the_live_count_are_skipped_as_zeros(live):
    """``rows``: a batch's padding (the rows from it on) is not computed; the live rows
    are bit for bit what a full product gives (a traced count, as a decode step has)."""
    rng = np.random.default_rng(live)
    x = jnp.asarray(rng.standard_normal((13, 70), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((70, 130), dtype=np.float32))
    full = np.asarray(jax.jit(cpu.dense_matmul_cpu)(x, w))
    part = np.asarray(jax.jit(lambda x, w, r: dm.dense_matmul(x, w, backend="cpu", rows=r))(
        x, w, jnp.int32(live)))
    shown = min(live, 13)
    np.testing.assert_array_equal(part[:shown], full[:shown])
    assert not part[shown:].any()
