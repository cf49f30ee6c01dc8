"""Stateless pieces of the decoder shared by every family: projections, RMSNorm in both
conventions, rotate-half RoPE (also partial), and the gated MLP's activations."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.precision import dot_precision


def project(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``einsum(spec, x, w)``, in true float32 when the operands are float32 (not TF32 on a
    GPU or bfloat16 passes on a TPU: ``pallas_kernels.precision``)."""
    return jnp.einsum(spec, x, w, precision=dot_precision(x.dtype))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm over the last axis. ``offset=0``: Llama's ``weight * normed`` (normed cast to
    x's dtype first); else Gemma's ``normed * (offset + weight)`` in float32, then cast."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


RopeTable = tuple  # (cos, sin): float32 [T, 1, 2 * len(inv_freq)] each (``rope_table``)


def rope_table(positions: jax.Array, inv_freq: jax.Array, once: bool = True) -> RopeTable:
    """The cosines and sines RoPE rotates by, for positions int32 [T]. ``once``: computed
    once for the forward pass, every layer (and q and k) reusing them; otherwise XLA fuses
    them into each rotation and recomputes them per element, which is cheaper only for
    small programs (the conditional that keeps them apart costs the host a little per
    call; numbers in ``docs/benchmarks/design_measurements.md``)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]   # [T, D/2]
    both = jnp.concatenate([angles, angles], axis=-1)                    # [T, D]
    # Computed inside a conditional (both branches alike, the predicate unknown at compile
    # time), so the results are materialized once. As plain ops XLA fuses cos and sin
    # into every consumer, recomputing them per head and per layer (an optimization
    # barrier does not stop it: XLA drops it before fusing; a no-op sort does, at a cost).
    trig = lambda b: (jnp.cos(b), jnp.sin(b))  # noqa: E731
    cos, sin = (jax.lax.cond(positions[0] >= 0, trig, trig, both)
                if once and positions.shape[0] else trig(both))
    return cos[:, None, :], sin[:, None, :]


def rotate(x: jax.Array, table: RopeTable) -> jax.Array:
    """Rotate-half RoPE (Hugging Face layout) of x [T, H, D] by ``table`` on its first
    ``table``-width channels (all of them but for partial rotary)."""
    cos, sin = table
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return jnp.concatenate([rotate(x[..., :rotary], table), x[..., rotary:]], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


ACTIVATIONS = {"silu": jax.nn.silu,
               "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}
