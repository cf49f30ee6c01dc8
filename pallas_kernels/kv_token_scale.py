"""Per-token scales of an int8 KV cache: one byte per token and KV head, for keys and values.

A scale per KV head and channel, calibrated once (``kv_quant``), leaves int8 keys and
values at 98% teacher-forced top-1 agreement with float32 on held-out text (SmolLM2); a
scale per token and KV head reaches 99.3% (``scripts/bench_kv_scale_schemes.py``,
``docs/quantization.md``). Such a scale is stored beside its token in the cache, as a
byte: the scale ``2 ** ((code - ZERO_CODE) / STEPS)`` nearest above the token's largest
|value| / 127 (rounded up, so no value saturates), 16 steps per octave over 16 octaves,
2^-13.5 to 2^2.44: tokens whose largest |value| lies in 0.011 .. 690 keep all 127 steps
(smaller ones are rounded to steps of 2^-13.5, larger ones saturate). SmolLM2's rotated
keys reach 0.54 .. 12.8 and its values 0.044 .. 13.9 on held-out text. Measured there
through the engine: 99.26% top-1 (16 steps per octave centred elsewhere: 99.36%; 8 steps
over 32 octaves: 99.21%; emulated with a float32 scale: 99.29%).

Where, in the split layout (CPUs, GPUs; ``applies``): two more uint8 arrays
``[L, N, B, Hkv]`` beside keys and values (``kv_layout``): 2 bytes per token and head next
to the 2 x D of its key and value, moved, swapped and transferred with their blocks like
every cache array.

Where, in the fused layout (TPUs; ``embedded``): inside the value's own bytes, no array
added. A separate byte array does not fit a TPU: XLA:TPU tiles an array's two minor
dimensions in 128 lanes, so a ``[B, Hkv]`` (or ``[2 Hkv B]``) byte row per block is padded
to 128 lanes or laid out blocks-minor, where a kernel cannot copy one block's codes; and a
fused row has no spare lanes at head_dim 64 or 128. So the lowest bit of the value's
first 16 codes carries the two scale codes, ``EMBEDDED_BITS`` each: bit ``i`` of the
key's code is the parity of value code ``i``, bit ``i`` of the value's own code that of
value code ``8 + i``. Those 16 codes are rounded to the nearest integer of that parity
(a step of 2 instead of 1, -128..127): every byte still reads as a plain int8, and the
keys keep all 127 steps (keys carry most of the error; emulated on held-out text, codes
in the values: 99.22% top-1, in 8 of the key's and 8 of the value's codes: 99.08%,
beside the token in their own bytes: 99.38%; ``scripts/bench_kv_scale_schemes.py``).
Needs ``head_dim >= 16``.

Reading: a block's key bytes decoded times the key scale of their token (and the
per-channel scales, ones here), likewise values; every kernel does this as it converts a
block (``token_scale_values``), the C++ one through ``table()``, the Mosaic TPU one after
summing the codes out of the value's parities (``embedded_codes``).
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
EMBEDDED_BITS = 8  # bits of a code, one per value byte, in the fused layout (``embedded``)


def per_token(kv_format: str | None) -> bool:
    """Whether a cache of ``kv_format`` keeps a scale per token (in any layout): then its
    per-channel scales are ones and nothing is calibrated."""
    return kv_format == FORMAT


def applies(kv_format: str | None, layout: str) -> bool:
    """Whether a cache of ``kv_format`` in ``layout`` stores per-token scales as arrays of
    their own (the split layout's)."""
    return per_token(kv_format) and layout == kv_layout.SPLIT


def embedded(kv_format: str | None, layout: str) -> bool:
    """Whether a cache of ``kv_format`` in ``layout`` keeps its per-token scale codes in
    the low bits of each value's first ``2 * EMBEDDED_BITS`` bytes (the fused layout's)."""
    return per_token(kv_format) and layout == kv_layout.FUSED


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


def _codes(x: jax.Array) -> jax.Array:
    """float32 [..., D] -> uint8 [...]: the code of the smallest scale at or above the
    largest |x| / 127 (the largest code where that is past the range; the smallest where
    x is 0)."""
    needed = jnp.max(jnp.abs(x), axis=-1) / MAX_VALUE[FORMAT]
    exponent = jnp.ceil(jnp.log2(jnp.maximum(needed, 1e-30)) * STEPS)
    return jnp.clip(exponent + ZERO_CODE, 0, 255).astype(jnp.uint8)


def encode_per_token(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, Hkv, D] (rotated keys or values, ``kv_quant.rotation``) -> (bytes uint8
    [T, Hkv, D] of ``x / scale``, scale codes uint8 [T, Hkv]); ``scale`` is the code's
    value (``_codes``)."""
    x = x.astype(jnp.float32)
    codes = _codes(x)                                                       # [T, Hkv]
    return encode(x / token_scale_values(codes)[..., None], FORMAT), codes


def _bits(codes: jax.Array) -> jax.Array:
    """uint8 [...] -> int32 [..., EMBEDDED_BITS]: each code's bits, lowest first."""
    return (codes.astype(jnp.int32)[..., None] >> jnp.arange(EMBEDDED_BITS)) & 1


def check_embeddable(head_dim: int) -> None:
    """Raise ``ValueError`` unless a value of ``head_dim`` bytes can carry both codes."""
    if head_dim < 2 * EMBEDDED_BITS:
        raise ValueError(f"an int8 KV cache in the fused layout (TPUs) keeps its scale codes "
                         f"in the values' first {2 * EMBEDDED_BITS} bytes: head_dim={head_dim} "
                         f"is too small (use kv_cache_dtype='fp8')")


def check_cache(kv_format: str | None, layout: str, head_dim: int) -> None:
    """Raise ``ValueError`` when a cache of ``kv_format`` in ``layout`` cannot be built
    for ``head_dim`` (an embedded int8 cache needs ``check_embeddable``'s bytes)."""
    if embedded(kv_format, layout):
        check_embeddable(head_dim)


def encode_embedded(k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rotated keys and values [T, Hkv, D] -> their bytes uint8 [T, Hkv, D] each, as the
    fused layout stores them: ``encode_per_token``'s, but the value's first
    ``2 * EMBEDDED_BITS`` codes hold the key's and the value's scale codes in their
    parity (each rounded to the nearest integer of the parity its bit asks for)."""
    check_embeddable(v.shape[-1])
    k_bytes, k_codes = encode_per_token(k)
    v = v.astype(jnp.float32)
    v_codes = _codes(v)
    scaled = v / token_scale_values(v_codes)[..., None]                     # [T, Hkv, D]
    carried = 2 * EMBEDDED_BITS
    bit = jnp.concatenate([_bits(k_codes), _bits(v_codes)], axis=-1)         # [T, Hkv, 16]
    # clipped first (a token past the codes' range saturates, as encode does), then the
    # nearest integer of the bit's parity, kept inside -128..127
    target = jnp.clip(scaled[..., :carried], -128.0, 127.0)
    near = 2 * jnp.round((target - bit) / 2).astype(jnp.int32) + bit
    near = jnp.where(near > 127, near - 2, jnp.where(near < -128, near + 2, near))
    carrying = jax.lax.bitcast_convert_type(near.astype(jnp.int8), jnp.uint8)
    rest = encode(scaled[..., carried:], FORMAT)
    return k_bytes, jnp.concatenate([carrying, rest], axis=-1)


def embedded_codes(v_bytes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A fused int8 cache's value bytes uint8 [..., D] -> the key's and the value's scale
    codes, int32 [...] each (``encode_embedded``)."""
    parity = v_bytes[..., :2 * EMBEDDED_BITS].astype(jnp.int32) & 1          # [..., 16]
    weights = 1 << jnp.arange(EMBEDDED_BITS, dtype=jnp.int32)
    k_codes = jnp.sum(parity[..., :EMBEDDED_BITS] * weights, axis=-1)
    v_codes = jnp.sum(parity[..., EMBEDDED_BITS:] * weights, axis=-1)
    return k_codes, v_codes
