"""Quantized weights in plain jnp: dequantize, then an ordinary dot.

On a TPU or GPU, XLA fuses the conversion into the dot's operand, so the weight is read
from memory in its quantized form and never stored as floats. This is the ground truth
the C++ CPU kernel is tested against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.precision import dot_precision


def unpack_nibbles(codes: jax.Array) -> jax.Array:
    """uint8 [K / 2, N] (row 2i low nibble, row 2i + 1 high) -> uint8 [K, N] in 0..15."""
    low, high = codes & 15, codes >> 4
    return jnp.stack([low, high], axis=1).reshape(2 * codes.shape[0], codes.shape[1])


def dequantize(weight: dict[str, jax.Array], dtype=jnp.float32) -> jax.Array:
    """A quantized weight (see the package) -> W [K, N] in ``dtype``."""
    codes, scale = weight["codes"], weight["scale"]
    q = unpack_nibbles(codes) if codes.dtype == jnp.uint8 else codes
    k, n = q.shape
    groups = scale.shape[0]
    w = q.reshape(groups, k // groups, n).astype(jnp.float32) * scale[:, None, :]
    if "zero" in weight:
        w = w + weight["zero"][:, None, :]
    return w.reshape(k, n).astype(dtype)


def quantized_matmul(x: jax.Array, weight: dict[str, jax.Array]) -> jax.Array:
    """x [M, K] @ W -> [M, N] in x's dtype."""
    return jnp.dot(x, dequantize(weight, x.dtype), precision=dot_precision(x.dtype))
