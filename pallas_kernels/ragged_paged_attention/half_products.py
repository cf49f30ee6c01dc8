"""Byte KV pages multiplied in float16 by the GPU kernel: the conversions that make them
cheap and the scaling that keeps it safe.

Why: a byte cache's pages must become 16-bit floats before the tensor cores multiply
them, and in the one-byte decode kernels that conversion, not the bytes read, is what
bounds them (``pallas_kernels/README.md``: they process barely more KV elements a second
than bfloat16's kernel). Per element, to bfloat16, Triton spends:

* e4m3: a hardware conversion to float16 (``cvt.rn.f16x2.e4m3x2``, two per instruction)
  and then one more per element to bfloat16 (``cvt.bf16.f16``), on the GPU's slowest pipe
  (16 conversions a clock per SM);
* int8: two instructions (per four bytes two ``prmt``, four ``and`` and two
  ``sub.bf16x2``: bfloat16's 7 mantissa bits cannot hold ``128 + u`` for every byte ``u``,
  so the top bit is split off and taken away apart);
* e5m2: its conversion to float16 is the byte moved into float16's upper byte.

Multiplied in float16 instead (queries, pages and probabilities; with ``int8_queries``
the values and probabilities only), each page element
costs (H100 PTX of the Llama-3-8B decode tile, ``scripts/kernel_ptx_ops.py``):

* e4m3: Triton's hardware conversion alone (the second conversion is gone);
* int8: 1.25 instructions, inline PTX four bytes at a time (``int8_in_halves``): one
  ``xor`` makes the four codes offset-binary (``u = c + 128``), two ``prmt`` put each
  ``u`` under float16's exponent of 1,024 (the bits ``0x64uu`` are ``1024 + u``), two
  ``sub.f16x2`` take 1,152 off: exactly ``c``. (Triton's own float16 cast of int8 is a
  conversion instruction an element, ``cvt.rn.f16.s16``, and the same arithmetic written
  in jnp compiled to scalar 16-bit shifts and masks, 3-7 instructions an element.)
* e5m2: 0.5 instructions, two ``prmt`` per four bytes (``e5m2_in_halves``), exact.

Interpret mode (and any call that asks for no inline PTX) converts with ``jnp`` to the same
float16 values: every int8, e4m3 and e5m2 value is exact in float16.

What float16 needs that bfloat16 does not: range. Its largest value is 65,504, so

* each query row is multiplied by a power of two that brings its largest |value| under
  2^15 (rows already under it are unchanged), and its scores by the inverse
  (``queries_in_halves``): exact, as powers of two are, and only rows that would not fit
  lose low bits;
* probabilities (at most 1) are ``2^PROBABILITY_EXPONENT`` times their value when they
  become float16, so that small ones keep float16's 11 bits instead of falling into its
  subnormals (below 2^-14): the kernel takes the exponent off each row's maximum before
  its exp2 (a subtraction a row, not a multiply a score), and the row sums carry the same
  factor, which the final division by them removes.

Float16 keeps 3 more bits of each query and probability than bfloat16, so its results
are closer to float32's, not further.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kv_quant import decode, decode_in_integers

FORMATS = ("fp8_e4m3", "int8", "fp8_e5m2")  # the byte formats the kernel can multiply in float16
PROBABILITY_EXPONENT = 12       # probabilities (<= 1) times 2^12 stay under float16's 65,504
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



# Four int8 codes (one 32-bit register, element i in byte i) -> four float16 (two
# registers, elements 0, 1 and 2, 3, the lower element in the lower half).
_INT8_ASM = """{
.reg .b32 u, lo, hi, k;
xor.b32 u, $2, 0x80808080;
prmt.b32 lo, u, 0x64, 0x4140;
prmt.b32 hi, u, 0x64, 0x4342;
mov.b32 k, 0x64806480;
sub.f16x2 $0, lo, k;
sub.f16x2 $1, hi, k;
}"""
# Four e5m2 bytes -> four float16: each byte is its float16's upper byte.
_E5M2_ASM = """{
prmt.b32 $0, 0, $2, 0x5040;
prmt.b32 $1, 0, $2, 0x7060;
}"""
_ASM = {"int8": _INT8_ASM, "fp8_e5m2": _E5M2_ASM}


def bytes_in_halves(stored: jax.Array, kv_format: str, *, inline_ptx: bool,
                    fp8_in_integers: bool = False) -> jax.Array:
    """uint8 pages (any shape whose last dimension is a multiple of 4) -> the float16
    values they hold. ``inline_ptx`` (inside a Triton kernel only): int8 and e5m2 through
    the PTX above, four bytes an instance; e4m3 through Triton's conversion (or built from
    its fields where ``fp8_in_integers``: ``kv_quant.decode_in_integers``). Without it, or
    for e4m3, the ``jnp`` conversion: the same values, every one exact in float16."""
    if inline_ptx and kv_format in _ASM:
        return plgpu.elementwise_inline_asm(
            _ASM[kv_format], args=[stored], constraints="=r,=r,r", pack=4,
            result_shape_dtypes=[jax.ShapeDtypeStruct(stored.shape, jnp.float16)])[0]
    convert = decode_in_integers if fp8_in_integers else decode
    return convert(stored, kv_format, jnp.float16)
