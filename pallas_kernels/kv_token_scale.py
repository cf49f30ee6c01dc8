"""Per-token scales of an int8 KV cache: one byte per token and KV head, for keys and values.

A scale per KV head and channel, calibrated once (``kv_quant``), leaves int8 keys and
values at 98% teacher-forced top-1 agreement with float32 on held-out text (SmolLM2); a
scale per token and KV head reaches 99.3% (``scripts/bench_kv_scale_schemes.py``,
``docs/quantization.md``). Such a scale is stored beside its token in the cache, as a
byte: the scale ``2 ** ((code - ZERO_CODE) / STEPS)`` nearest above the token's largest
|value| / 127 (rounded up, so no value saturates), 16 steps per octave over 16 octaves,
2^-13.5 to 2^2.5: tokens whose largest |value| lies in 0.011 .. 690 keep all 127 steps
(smaller ones are rounded to steps of 2^-13.5, larger ones saturate). SmolLM2's rotated
keys reach 0.54 .. 12.8 and its values 0.044 .. 13.9 on held-out text. Measured there
through the engine: 99.26% top-1 (16 steps per octave centred elsewhere: 99.36%; 8 steps
over 32 octaves: 99.21%; emulated with a float32 scale: 99.29%).

Where: the split layout's int8 cache (``applies``), as two more uint8 arrays
``[L, N, B, Hkv]`` beside keys and values (``kv_layout``): 2 bytes per token and head next
to the 2 x D of its key and value, moved, swapped and transferred with their blocks like
every cache array. The fused TPU layout keeps the per-channel scales only (a
``[B, Hkv]`` byte array there is padded to 128 lanes: 128x its bytes at one head).

Reading: a block's key bytes decoded times the key scale of their token (and the
per-channel scales, ones here), likewise values; every kernel does this as it converts a
block (``token_scale_values``), the C++ one through ``table()``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_layout
from pallas_kernels.kv_quant import MAX_VALUE, encode

STEPS = 16        # codes per octave
ZERO_CODE = 216   # the code of scale 1.0: codes 0..255 span 2^-13.5 .. 2^2.44
FORMAT = "int8"   # the only byte format with token scales (fp8 gains nothing: its
#                   relative error is the format's, 96.5% -> 96.7%)


def applies(kv_format: str | None, layout: str) -> bool:
    """Whether a cache of ``kv_format`` in ``layout`` stores per-token scales."""
    return kv_format == FORMAT and layout == kv_layout.SPLIT


def table() -> np.ndarray:
    """float32 [256]: the scale of every code."""
    return (2.0 ** ((np.arange(256) - ZERO_CODE) / STEPS)).astype(np.float32)


def token_scale_values(codes: jax.Array, dtype=jnp.float32) -> jax.Array:
    """uint8 scale codes (any shape) -> the scales they stand for, in ``dtype``: exactly
    ``table()``'s (what the model divides by, and the C++ kernel multiplies by)."""
    return jnp.asarray(table())[codes.astype(jnp.int32)].astype(dtype)


def token_scale_values_computed(codes: jax.Array) -> jax.Array:
    """``token_scale_values`` as float32 arithmetic, within an ulp of the table: for
    kernels, which hold no table (Pallas kernels take no captured constants)."""
    return jnp.exp2((codes.astype(jnp.float32) - ZERO_CODE) * (1.0 / STEPS))


def encode_per_token(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, Hkv, D] (rotated keys or values, ``kv_quant.rotation``) -> (bytes uint8
    [T, Hkv, D] of ``x / scale``, scale codes uint8 [T, Hkv]); ``scale`` is the code's
    value, the smallest at or above each token and head's largest |x| / 127 (the
    largest code where that is past the range; the smallest where x is 0)."""
    x = x.astype(jnp.float32)
    needed = jnp.max(jnp.abs(x), axis=-1) / MAX_VALUE[FORMAT]               # [T, Hkv]
    exponent = jnp.ceil(jnp.log2(jnp.maximum(needed, 1e-30)) * STEPS)
    codes = jnp.clip(exponent + ZERO_CODE, 0, 255).astype(jnp.uint8)
    scale = token_scale_values(codes)
    return encode(x / scale[..., None], FORMAT), codes
