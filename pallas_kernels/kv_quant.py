"""One-byte KV cache formats: how keys and values are stored when the cache is quantized.

A quantized cache holds every element as one byte, in ``uint8`` arrays whatever the
format (so the cache's shape, sharding, block copies, swaps and transfers never depend
on it); ``kv_format`` says how to read a byte:

* ``"int8"``: a signed integer (two's complement), -127..127 written;
* ``"fp8_e4m3"``: float8 e4m3fn (max 448), the format of vLLM's ``fp8`` / ``fp8_e4m3``;
* ``"fp8_e5m2"``: float8 e5m2 (max 57344).

The cache holds ``k / k_scale`` and ``v / v_scale`` of keys and values rotated by
``rotation`` (the model rotates q, k and v before the cache and the output back), scales
per KV head and channel
(``[Hkv, D]`` for the layer read; ``jaxpage.models``). The C++ CPU kernel multiplies the
scales in as it converts each block; for the other backends ``fold_key_scale`` puts the key
scales into the queries (``q . (s * k') = (q * s) . k'``) and ``unfold_value_scale`` the
value scales into the output, so those kernels only convert bytes (``decode``).

An int8 cache also keeps a scale per token and KV head (``kv_token_scale``): a byte in
arrays beside the pages in the split layout (CPUs, GPUs), in the parity of the value's
first 16 bytes in the fused one (TPUs); its per-channel scales are then ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

KV_FORMATS = {"int8": jnp.int8, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
STORAGE_DTYPE = jnp.uint8
# the largest magnitude written in each format (int8 keeps the range symmetric)
MAX_VALUE = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


def check_format(kv_format: str | None) -> None:
    if kv_format is not None and kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format={kv_format!r} is not one of {tuple(KV_FORMATS)} or None")


def decode(stored: jax.Array, kv_format: str, dtype=jnp.float32) -> jax.Array:
    """uint8 bytes -> the values they hold, in ``dtype``."""
    return jax.lax.bitcast_convert_type(stored, KV_FORMATS[kv_format]).astype(dtype)


def decode_in_integers(stored: jax.Array, kv_format: str, dtype=jnp.float32) -> jax.Array:
    """``decode`` without an FP8 conversion, for compilers that have none: Triton below
    compute capability 8.9 (an A100) stops the process with "Conversion from/to f8e4m3nv
    is only supported on compute capability >= 89". An e4m3fn byte ``s eeee mmm`` is
    ``(-1)^s 2^(e-7) (1 + m/8)``, or ``(-1)^s 2^-6 m/8`` when ``e == 0``: its float32 bits
    are built from the fields (exact for every byte but the NaNs, never written). Other
    formats convert as ``decode`` does (e5m2's conversion is a shift there)."""
    if kv_format != "fp8_e4m3":
        return decode(stored, kv_format, dtype)
    b = stored.astype(jnp.int32)
    sign, exponent, mantissa = (b >> 7) & 1, (b >> 3) & 15, b & 7
    normal = jax.lax.bitcast_convert_type(
        (sign << 31) | ((exponent + 120) << 23) | (mantissa << 20), jnp.float32)
    subnormal = (mantissa.astype(jnp.float32) * (2.0 ** -9)) * (1 - 2 * sign).astype(jnp.float32)
    return jnp.where(exponent == 0, subnormal, normal).astype(dtype)


def encode(values: jax.Array, kv_format: str) -> jax.Array:
    """Floats (already divided by their scale) -> uint8 bytes, saturating at the format's
    largest value (int8 rounds to the nearest integer)."""
    limit = MAX_VALUE[kv_format]
    x = jnp.clip(values.astype(jnp.float32), -limit, limit)
    if kv_format == "int8":
        x = jnp.round(x)
    return jax.lax.bitcast_convert_type(x.astype(KV_FORMATS[kv_format]), STORAGE_DTYPE)


def rotation(head_dim: int) -> np.ndarray:
    """float32 [D, D] orthogonal: the rotation a byte cache stores keys and values in.

    ``q . k = (q R) . (k R)`` for any orthogonal R, and the attention output of rotated
    values is the output rotated (``sum p (v R) = (sum p v) R``), so the model rotates q,
    k and v before the cache and the output back after it, and every kernel and layout
    stays as it is. What R buys: keys carry a few channels far larger than the rest, and a
    few tokens (the first, above all) far larger than the others; rotated, each channel
    mixes all of them, so the per-channel scales fit every token better. Measured on the
    tuning text (``scripts/bench_quantization_quality.py``, SmolLM2): int8 KL 0.0019 ->
    0.0015, fp8 e4m3 0.0091 -> 0.0053. R is the normalized Walsh-Hadamard matrix when D is
    a power of two (entries +-1/sqrt(D)), else a fixed seeded random orthogonal matrix.
    """
    if head_dim & (head_dim - 1) == 0:
        r = np.ones((1, 1))
        while r.shape[0] < head_dim:
            r = np.block([[r, r], [r, -r]])
        return (r / np.sqrt(head_dim)).astype(np.float32)
    q, upper = np.linalg.qr(np.random.default_rng(head_dim).standard_normal((head_dim, head_dim)))
    return (q * np.sign(np.diag(upper))).astype(np.float32)


def lookup_table(kv_format: str) -> np.ndarray:
    """float32 [256]: the value of every byte (what the C++ kernel converts through)."""
    as_format = np.arange(256, dtype=np.uint8).view(np.dtype(KV_FORMATS[kv_format]))
    table = as_format.astype(np.float32)
    return np.where(np.isfinite(table), table, 0.0).astype(np.float32)  # NaN bytes: never written


def _per_query_head(scale: jax.Array, num_q_heads: int, dtype) -> jax.Array:
    """[Hkv, D] -> [Hq, D]: each KV head's scales for every query head of its group."""
    return jnp.repeat(scale, num_q_heads // scale.shape[0], axis=0).astype(dtype)


def fold_key_scale(q: jax.Array, k_scale: jax.Array | None) -> jax.Array:
    """q [T, Hq, D] with the key scales [Hkv, D] multiplied in."""
    if k_scale is None:
        return q
    return q * _per_query_head(k_scale, q.shape[1], q.dtype)


def unfold_value_scale(out: jax.Array, v_scale: jax.Array | None) -> jax.Array:
    """The attention output [T, Hq, D] with the value scales [Hkv, D] multiplied in."""
    if v_scale is None:
        return out
    return out * _per_query_head(v_scale, out.shape[1], out.dtype)
