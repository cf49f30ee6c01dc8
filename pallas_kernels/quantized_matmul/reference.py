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
    """x [M, K] @ W -> [M, N] in x's dtype.

    One scale group (per channel or per tensor): ``(x @ q) * scale (+ sum(x) * zero)``,
    the codes converted to x's dtype (exactly: at most 8 significant bits) as the dot's
    operand. Compiled for an H100 or a TPU v5e, XLA fuses that conversion into the dot and
    the weight is read as stored; with the scales multiplied in first (the grouped form
    below) both materialize a dequantized copy of the weight per call (Llama-3-8B's MLP
    weight: 112 MiB of bfloat16 on an H100, 224 MiB of float32 on a v5e; see
    docs/quantization.md)."""
    if weight["scale"].shape[0] == 1:
        codes = weight["codes"]
        q = unpack_nibbles(codes) if codes.dtype == jnp.uint8 else codes
        acc = jnp.dot(x, q.astype(x.dtype), precision=dot_precision(x.dtype),
                      preferred_element_type=jnp.float32)                     # [M, N]
        y = acc * weight["scale"].astype(jnp.float32)
        if "zero" in weight:
            y = y + jnp.sum(x.astype(jnp.float32), axis=-1, keepdims=True) * weight["zero"]
        return y.astype(x.dtype)
    return jnp.dot(x, dequantize(weight, x.dtype), precision=dot_precision(x.dtype))
