"""The precision every matmul of the engine asks for: float32 means float32.

On a GPU, XLA and Triton compute a float32 dot at their default precision in TF32 (10
mantissa bits), and on a TPU in bfloat16 passes; on the CPU a float32 dot is always
exact float32. A model served in float32 must give the reference model's tokens on every
platform, so float32 operands ask for ``HIGHEST``; bfloat16 and float16 operands keep the
default (the matrix units' own precision, accumulated in float32 where asked).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def dot_precision(dtype) -> lax.Precision | None:
    """``lax.Precision.HIGHEST`` for float32 operands, else None (the platform's default)."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
