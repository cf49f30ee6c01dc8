"""Matmuls whose weight is stored quantized (weight-only: activations stay in the model dtype).

A quantized weight W [K, N] (in_features x out_features, the model's layout) is a dict
of arrays, its scales per group of ``K / G`` consecutive rows:

* 8-bit, symmetric: ``{"codes": int8 [K, N], "scale": float32 [G, N]}``,
  ``W[k, n] = scale[k // (K/G), n] * codes[k, n]``. Per output channel is ``G = 1``.
* 4-bit, asymmetric: ``{"codes": uint8 [K/2, N], "scale": float32 [G, N],
  "zero": float32 [G, N]}``: two codes per byte (row ``2i`` in the low nibble of byte row
  ``i``, row ``2i + 1`` in the high nibble), ``W[k, n] = scale[g, n] * q[k, n] + zero[g, n]``
  with ``q`` in 0..15.

GGUF's Q8_0, Q4_0 and Q4_1 blocks (32 weights along K) are these formats with ``G = K/32``.

Backends (``_backend``'s rule): ``"reference"`` dequantizes in jnp and calls an ordinary
dot; on a TPU or GPU XLA fuses the conversion into the dot, so the weight is read from
memory as stored. On the CPU that fusion is slow (XLA converts int8 at ~1 ns an element),
so ``"auto"`` there takes the C++ kernels of ``cpu.py`` for float32 activations: each
panel of 64 columns is converted once into a buffer and multiplied by
``dense_matmul``'s register tiles, so the products are bit for bit those of
``dense_matmul`` on the dequantized weight, at any number of rows.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import _backend
from pallas_kernels.quantized_matmul import reference

BACKENDS = ("auto", "reference", "cpu")


def is_quantized(weight: Any) -> bool:
    """Whether ``weight`` is a quantized weight dict (not a plain array)."""
    return isinstance(weight, dict) and "codes" in weight


def weight_shape(weight: dict[str, Any]) -> tuple[int, int]:
    """(K, N) of a quantized weight; raises ``ValueError`` when its parts disagree."""
    codes, scale = weight["codes"], weight["scale"]
    four = "zero" in weight
    if jnp.dtype(codes.dtype) != jnp.dtype(jnp.uint8 if four else jnp.int8):
        raise ValueError(f"quantized weight codes must be {'uint8' if four else 'int8'}, got "
                         f"{codes.dtype}")
    if codes.ndim != 2 or scale.ndim != 2 or scale.shape[1] != codes.shape[1]:
        raise ValueError(f"quantized weight: codes {codes.shape} and scale {scale.shape} "
                         "must be [K, N] and [G, N]")
    k = codes.shape[0] * (2 if four else 1)
    if k % scale.shape[0] or (four and (k // scale.shape[0]) % 2):
        raise ValueError(f"quantized weight: {scale.shape[0]} groups do not divide K={k}"
                         + (" into even groups" if four else ""))
    if four and tuple(weight["zero"].shape) != tuple(scale.shape):
        raise ValueError(f"quantized weight: zero {weight['zero'].shape} must match scale "
                         f"{scale.shape}")
    return k, codes.shape[1]


def resolve_backend(backend: str, dtype: Any) -> str:
    """"reference" or "cpu" for activations of ``dtype`` here (building the kernels)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    platform = _backend.current_platform()
    if backend == "cpu" and platform != "cpu":
        raise ValueError(f"backend='cpu' runs only on the CPU, but the platform is {platform!r}")
    if backend == "auto":
        backend = "cpu" if platform == "cpu" else "reference"
    if backend == "cpu":
        from pallas_kernels.quantized_matmul import cpu
        if jnp.dtype(dtype) != jnp.float32 or not cpu.available():
            return "reference"
    return backend


def quantized_matmul(x: jax.Array, weight: dict[str, jax.Array], *,
                     backend: str = "auto", rows: jax.Array | None = None) -> jax.Array:
    """``x [..., K] @ W -> [..., N]`` in x's dtype, W given quantized (see the module).
    ``rows``: as ``dense_matmul``'s (the rows past it are padding, results unspecified)."""
    k, n = weight_shape(weight)
    if x.shape[-1] != k:
        raise ValueError(f"x {x.shape} and the quantized weight [{k}, {n}] disagree on K")
    lead = x.shape[:-1]
    flat = x.reshape(-1, k)
    if flat.shape[0] == 0:
        return jnp.zeros((*lead, n), x.dtype)
    if resolve_backend(backend, x.dtype) == "cpu":
        from pallas_kernels.quantized_matmul import cpu
        out = cpu.quantized_matmul_cpu(flat, weight, rows)
    else:
        out = reference.quantized_matmul(flat, weight)
    return out.reshape(*lead, n).astype(x.dtype)


def dequantize(weight: dict[str, jax.Array], dtype: Any = jnp.float32) -> jax.Array:
    """W [K, N] in ``dtype``."""
    weight_shape(weight)
    return reference.dequantize(weight, dtype)


def gather_columns(weight: dict[str, jax.Array], ids: jax.Array, dtype: Any) -> jax.Array:
    """Columns ``ids`` [T] of W, as rows: ``W[:, ids].T`` -> [T, K] in ``dtype``.

    This is an embedding lookup for a table stored as a quantized ``[hidden, vocab]``
    weight (the layout a tied LM head multiplies by); only the T columns are converted.
    """
    weight_shape(weight)
    picked = {name: jnp.take(part, ids, axis=1) for name, part in weight.items()}
    return reference.dequantize(picked, dtype).T
