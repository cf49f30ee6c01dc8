"""The C++ CPU quantized matmuls against the jnp reference, and the weight checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantized_matmul import (SMALL_M, dequantize, gather_columns,
                                             quantized_matmul, weight_shape)
from pallas_kernels.quantized_matmul import cpu, reference


def _weight(bits: int, k: int, n: int, groups: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    if bits == 8:
        return {"codes": jnp.asarray(rng.integers(-127, 128, (k, n), dtype=np.int8)),
                "scale": jnp.asarray(rng.random((groups, n), dtype=np.float32) / 100)}
    return {"codes": jnp.asarray(rng.integers(0, 256, (k // 2, n), dtype=np.uint8)),
            "scale": jnp.asarray(rng.random((groups, n), dtype=np.float32) / 10),
            "zero": jnp.asarray(rng.standard_normal((groups, n), dtype=np.float32))}


@pytest.mark.skipif(not cpu.available(), reason="no C++ compiler")
@pytest.mark.parametrize("bits,groups", [(8, 1), (8, 4), (4, 3), (4, 12)])
@pytest.mark.parametrize("m", [1, 5, SMALL_M, SMALL_M + 1, 40])
def test_cpu_kernels_match_the_reference(bits, groups, m):
    k, n = 96, 100  # n is not a multiple of the kernel's 64-column tiles
    weight = _weight(bits, k, n, groups)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((m, k), dtype=np.float32))
    ours = np.asarray(jax.jit(lambda x, w: quantized_matmul(x, w, backend="cpu"))(x, weight))
    ref = np.asarray(reference.quantized_matmul(x, weight))
    assert ours.shape == (m, n)
    np.testing.assert_allclose(ours, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())
    np.testing.assert_allclose(np.asarray(jax.jit(cpu.dequantize_cpu)(weight)),
                               np.asarray(dequantize(weight)), rtol=1e-6, atol=1e-6)


def test_leading_axes_other_dtypes_and_empty_rows():
    weight = _weight(4, 64, 32, 2)
    x = jnp.ones((2, 3, 64), jnp.bfloat16)  # not float32: the jnp form
    out = quantized_matmul(x, weight)
    assert out.shape == (2, 3, 32) and out.dtype == jnp.bfloat16
    assert quantized_matmul(jnp.ones((0, 64)), weight).shape == (0, 32)


def test_gather_columns_is_an_embedding_lookup():
    weight = _weight(8, 16, 50, 1)
    ids = jnp.asarray([3, 0, 49, 3])
    table = np.asarray(dequantize(weight))                      # [hidden, vocab]
    np.testing.assert_array_equal(np.asarray(gather_columns(weight, ids, jnp.float32)),
                                  table[:, [3, 0, 49, 3]].T)


def test_bad_weights_are_refused():
    good = _weight(4, 64, 32, 2)
    with pytest.raises(ValueError, match="uint8"):
        weight_shape({**good, "codes": good["codes"].astype(jnp.int8)})
    with pytest.raises(ValueError, match="groups"):
        weight_shape({**good, "scale": jnp.ones((3, 32)), "zero": jnp.ones((3, 32))})
    with pytest.raises(ValueError, match="disagree on K"):
        quantized_matmul(jnp.ones((1, 63)), good)
    with pytest.raises(ValueError, match="backend"):
        quantized_matmul(jnp.ones((1, 64)), good, backend="tpu")
