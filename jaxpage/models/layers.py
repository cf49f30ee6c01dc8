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


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE (Hugging Face layout) on the first ``2 * len(inv_freq)`` channels
    (all of them but for partial rotary). x: [T, H, D], positions: int32 [T]."""
    rotary = 2 * inv_freq.shape[0]
    if rotary < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotary], positions, inv_freq),
                                x[..., rotary:]], axis=-1)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]   # [T, D/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], axis=-1))[:, None, :]  # [T, 1, D]
    sin = jnp.sin(jnp.concatenate([angles, angles], axis=-1))[:, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


ACTIVATIONS = {"silu": jax.nn.silu,
               "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}
