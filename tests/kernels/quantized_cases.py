"""The check the Pallas quantized-matmul kernels' tests share (``test_quantized_matmul_tpu``,
``test_quantized_matmul_gpu``): a random weight quantized in ``fmt``, the kernel against the
jnp reference on random activations."""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np

from jaxpage.models.quantize import QuantFormat, quantize
from pallas_kernels.quantized_matmul import reference


def assert_kernel_matches_reference(kernel: Callable, supported: Callable, fmt: QuantFormat,
                                    k: int, n: int, m: int, dtype) -> None:
    """``kernel(x, parts)`` equals ``reference.quantized_matmul`` for x [m, k] in ``dtype``
    and a [k, n] weight the kernel ``supported``: float32 to 2e-6 of the largest output,
    bfloat16 to 8e-3 (4-bit's two nibble halves are summed apart)."""
    rng = np.random.default_rng(k + n + m)
    parts = {name: jnp.asarray(part) for name, part in
             quantize(rng.standard_normal((k, n)).astype(np.float32), fmt).items()}
    assert supported(parts, k, n)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    got = np.asarray(kernel(x, parts), np.float32)
    want = np.asarray(reference.quantized_matmul(x, parts), np.float32)
    assert got.shape == (m, n)
    tolerance = 2e-6 if dtype == jnp.float32 else 8e-3
    assert np.abs(got - want).max() <= tolerance * np.abs(want).max()
