"""Exponentials of the GPU attention kernel's softmax, as the PTX it should run.

Pallas' Triton lowering makes ``jnp.exp`` of float32 libdevice's ``expf`` (a range
reduction around its ``ex2``: about ten instructions a score) and ``jnp.exp2``
libdevice's ``exp2f`` (two multiplies and a select around it); a multiply and a
subtraction come out as ``mul.rn`` and ``sub.rn``, which ptxas never fuses into an FFMA.
So the kernel keeps its scores in base-2 units (their scale includes ``LOG2E``) and takes
its exponentials here: with ``fast`` (inside a Triton kernel on an NVIDIA GPU,
``_backend.runs_ptx``) as inline PTX, one ``ex2.approx.ftz`` (and one ``fma.rn``) an
element; otherwise (interpret mode) through ``jnp``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

LOG2E = 1.4426950408889634  # log2(e): e^x = 2^(x log2(e))


def exp2(x: jax.Array, fast: bool) -> jax.Array:
    """2^x of float32 x. ``fast``: one ``ex2.approx.ftz`` instruction each (inline PTX;
    results below 2^-126 flush to zero, which a softmax's probabilities may); else
    ``jnp.exp2``, which the Triton lowering makes libdevice's exp2f (subnormal handling
    around its ex2: two more multiplies and a select) and interpret mode runs exactly."""
    if not fast:
        return jnp.exp2(x)
    return plgpu.elementwise_inline_asm(
        "ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])[0]


def scaled_exp2(s: jax.Array, scale, offset: jax.Array, fast: bool) -> jax.Array:
    """2^(s * scale - offset) of float32 s [R, K] (``scale`` a float or [R, 1], ``offset``
    [R, 1]). ``fast``: one ``fma.rn`` and one ``ex2.approx.ftz`` an element (inline PTX:
    Triton writes a multiply and a subtraction with explicit rounding, ``mul.rn`` and
    ``sub.rn``, which ptxas never fuses into an FFMA); else ``jnp``."""
    if not fast:
        return jnp.exp2(s * scale - offset)
    scale = jnp.broadcast_to(jnp.asarray(scale, jnp.float32), s.shape)
    return plgpu.elementwise_inline_asm(
        "{ .reg .f32 t; fma.rn.f32 t, $1, $2, $3; ex2.approx.ftz.f32 $0, t; }",
        args=[s, scale, jnp.broadcast_to(-offset, s.shape)], constraints="=f,f,f,f",
        pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(s.shape, jnp.float32)])[0]
