"""How the paged KV cache sits in memory: split K and V pages, or fused token rows.

Two layouts, chosen per platform (``for_platform``) and behind one interface: the engine
holds its cache as a tuple of arrays (``KVCache``), every one ``[L, N, ...]`` with the
blocks on axis 1, and only the kernels look inside a block.

``"split"`` (CPUs, GPUs): ``(k_cache, v_cache)``, each ``[L, N, B, Hkv, D]``. What the C++
  CPU kernel and the Triton GPU kernel read; row-major on both platforms. An int8 cache
  adds its per-token scale codes: ``(k_cache, v_cache, k_scales, v_scales)``, the last
  two uint8 ``[L, N, B, Hkv]`` (``kv_token_scale``).

``"fused"`` (TPUs): ``(kv_cache,)``, ``[L, N, B, W]``: one row of ``W`` lanes per token
  holding all of its keys and values. Head ``h`` owns lanes ``[h * 2 * Dh, (h + 1) * 2 *
  Dh)``: its key in the first ``Dh`` of them, its value in the next ``Dh``, each zero-padded
  from ``D`` to ``Dh = half_width(D)`` (64 for ``D <= 64``, else a multiple of 128). An
  int8 cache keeps its per-token scale codes inside the value bytes (``kv_token_scale``),
  so it is this one array too.

Why TPUs need the fused rows: XLA:TPU stores the two minor dimensions of an array in
(8 sublane, 128 lane) tiles. When the minor dimension is narrower than 128 lanes (one KV
head of 64, or a ``[Hkv, D]`` pair whose ``Hkv`` is tiny), its default layout for the
cache moves the blocks axis minor-most instead of padding, while the kernels and the
scatter want the blocks major: every program then converted the whole cache on entry
and back on exit (``jaxpage plan``: 2.0x the cache in temporaries for Llama-3-8B at
TP=8). A fused row is ``Hkv * 2 * Dh`` lanes, always a multiple of 128, and the block
size (16 and up) fills the sublanes, so the default layout is row-major with no padding
for head_dim 64, 128 and 256 and any number of KV heads; other head dims pad each half
to ``Dh`` (see ``padding``). Splitting the heads over devices splits ``W`` on whole head
slots, each a multiple of 128 lanes, so every device's shard is row-major too.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

SPLIT, FUSED = "split", "fused"
LAYOUTS = (SPLIT, FUSED)
LANES = 128

KVCache = tuple  # (k_cache, v_cache[, k_scales, v_scales]) when split, (kv_cache,) when fused


def for_platform(platform: str) -> str:
    """The layout the engine allocates on ``platform`` ("tpu": fused; else split).

    ``JAXPAGE_KV_LAYOUT=fused`` (or ``split``) overrides it: how the CPU tests run the
    whole engine on the TPU layout (the CPU and GPU kernels then fall back to the
    reference, which reads both)."""
    forced = os.environ.get("JAXPAGE_KV_LAYOUT")
    if forced:
        if forced not in LAYOUTS:
            raise ValueError(f"JAXPAGE_KV_LAYOUT={forced!r} is not one of {LAYOUTS}")
        return forced
    return FUSED if platform == "tpu" else SPLIT


def half_width(head_dim: int) -> int:
    """``Dh``: the lanes a fused row gives one head's key (and as many its value)."""
    if head_dim < 1:
        raise ValueError(f"head_dim={head_dim} must be >= 1")
    return 64 if head_dim <= 64 else -(-head_dim // LANES) * LANES


def row_width(num_kv_heads: int, head_dim: int) -> int:
    """``W``: the lanes of one token's fused row (a multiple of 128)."""
    return num_kv_heads * 2 * half_width(head_dim)


def padding(head_dim: int) -> float:
    """Bytes a fused row stores per byte of keys and values (1.0: no padding)."""
    return half_width(head_dim) / head_dim


def heads_in_row(width: int, head_dim: int) -> int:
    """The KV heads a fused row of ``width`` lanes holds at ``head_dim``."""
    slot = 2 * half_width(head_dim)
    if width % slot:
        raise ValueError(f"a fused KV row of {width} lanes does not hold whole heads of "
                         f"head_dim {head_dim} ({slot} lanes each)")
    return width // slot


def cache_shapes(layout: str, num_layers: int, num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, token_scales: bool = False
                 ) -> tuple[tuple[int, ...], ...]:
    """The shape of each array of a ``layout`` cache (``num_blocks`` with the null block);
    ``token_scales``: with the per-token scale arrays (split only: a fused int8 cache
    keeps its codes in its value bytes, ``kv_token_scale``)."""
    if token_scales and layout != SPLIT:
        raise ValueError(f"per-token KV scales are stored in the {SPLIT!r} layout only, "
                         f"not {layout!r}")
    if layout == SPLIT:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        scales = (shape[:4],) * 2 if token_scales else ()
        return (shape, shape) + scales
    if layout == FUSED:
        return ((num_layers, num_blocks, block_size, row_width(num_kv_heads, head_dim)),)
    raise ValueError(f"kv layout {layout!r} is not one of {LAYOUTS}")


def as_pair(caches: KVCache) -> tuple[jax.Array, jax.Array | None]:
    """``(k_cache, v_cache)`` as the kernels take them; ``v_cache`` is None when fused."""
    return (caches[0], caches[1]) if len(caches) in (2, 4) else (caches[0], None)


def token_scales(caches: KVCache) -> tuple:
    """``(k_scales, v_scales)`` of a cache with per-token scales, else ``()``."""
    return tuple(caches[2:4])


def from_pair(k_cache: jax.Array, v_cache: jax.Array | None, scales: tuple = ()) -> KVCache:
    """The inverse of ``as_pair`` (and ``token_scales``)."""
    return (k_cache,) if v_cache is None else (k_cache, v_cache, *scales)


def fuse(k: jax.Array, v: jax.Array) -> jax.Array:
    """Keys and values ``[..., Hkv, D]`` -> fused rows ``[..., Hkv * 2 * Dh]``."""
    *lead, num_kv_heads, head_dim = k.shape
    pad = [(0, 0)] * (k.ndim - 1) + [(0, half_width(head_dim) - head_dim)]
    pair = jnp.stack([jnp.pad(k, pad), jnp.pad(v.astype(k.dtype), pad)], axis=-2)
    return pair.reshape(*lead, row_width(num_kv_heads, head_dim))


def unfuse(rows: jax.Array, head_dim: int) -> tuple[jax.Array, jax.Array]:
    """Fused rows ``[..., W]`` -> keys and values, each ``[..., Hkv, D]``."""
    *lead, width = rows.shape
    half = half_width(head_dim)
    pair = rows.reshape(*lead, heads_in_row(width, head_dim), 2, half)
    return pair[..., 0, :head_dim], pair[..., 1, :head_dim]
