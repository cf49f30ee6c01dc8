"""e4m3 KV pages multiplied in float16 by the GPU kernel: the scaling that keeps it safe.

Why: a byte cache's pages must become 16-bit floats before the tensor cores multiply
them. Triton converts e4m3 bytes to float16 in hardware (``cvt.rn.f16x2.e4m3x2``, two
per instruction) and then each float16 to bfloat16 with a conversion instruction of its
own (``cvt.bf16.f16``): per thread and loop step of the Llama-3-8B decode tile (128 keys
of 128 channels, K and V, 4 warps), 256 of the first and 512 of the second in the PTX of
the deviceless H100 compile, on the GPU's slowest pipe (16 conversions a clock per SM).
Multiplying in float16 drops the second conversion (0 left in that PTX;
``scripts/kernel_ptx_ops.py`` prints the counts). Every e4m3 value is exact in float16,
as in bfloat16.

Only e4m3 is taken this way. Triton converts int8 and e5m2 to bfloat16 with integer
operations already (a ``prmt`` or two per element and, for int8, a packed subtraction),
while its float16 casts of them are conversion instructions (``cvt.rn.f16.s16`` per int8
element; ``cvt.rn.f16x2.e5m2x2`` per two e5m2 bytes). Building the float16 bits by hand
(e5m2 is float16's upper byte; e4m3's fields moved to float16's places, which reads as
the value times 2^-8) compiled to scalar 16-bit shifts, masks and ors, 3-7 instructions
an element: more than either conversion.

What float16 needs that bfloat16 does not: range. Its largest value is 65,504, so

* each query row is multiplied by a power of two that brings its largest |value| under
  2^15 (rows already under it are unchanged), and its scores by the inverse
  (``queries_in_halves``): exact, as powers of two are, and only rows that would not fit
  lose low bits;
* probabilities (at most 1) are multiplied by ``PROBABILITY_SCALE`` before they become
  float16 and the sum by its inverse after, so that small ones keep float16's 11 bits
  instead of falling into its subnormals (below 2^-14).

Float16 keeps 3 more bits of each query and probability than bfloat16, so its results
are closer to float32's, not further.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FORMATS = ("fp8_e4m3",)  # the byte formats the kernel multiplies in float16
PROBABILITY_SCALE = 2.0 ** 12   # probabilities (<= 1) times it stay under float16's 65,504
QUERY_EXPONENT_LIMIT = 14        # rows are brought under 2^(limit + 1) = 32,768


def queries_in_halves(q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """q [R, D] (16-bit floats) -> (float16 [R, D], float32 [R]): each row times a power of
    two that brings its largest |value| under 2^15 (1 for rows already under it), and
    the power of two its scores must be multiplied by to undo that. Built from the
    float's exponent bits, so both are exact."""
    q32 = q.astype(jnp.float32)
    peak = jnp.max(jnp.abs(q32), axis=1)                                   # [R]
    exponent = (jax.lax.bitcast_convert_type(peak, jnp.int32) >> 23) & 0xFF  # biased
    shift = jnp.maximum(exponent - 127 - QUERY_EXPONENT_LIMIT, 0)          # [R] int32
    down = jax.lax.bitcast_convert_type((127 - shift) << 23, jnp.float32)  # 2^-shift
    up = jax.lax.bitcast_convert_type((127 + shift) << 23, jnp.float32)    # 2^shift
    return (q32 * down[:, None]).astype(jnp.float16), up

