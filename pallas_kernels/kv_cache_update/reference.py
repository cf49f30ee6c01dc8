"""Plain-jnp KV cache update: scatter new keys/values into their flat slots.

The scatter indexes (block, offset), or (layer, block, offset), and never reshapes the
cache: on a TPU a reshape that merges tiled dimensions is a copy of the whole cache. A
fused cache (``kv_layout``, ``v_cache`` None) takes each token's keys and values as one
row, fused from ``k_new`` / ``v_new`` (arrays the size of the new tokens, not the cache).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import kv_layout


def kv_cache_update_reference(
        k_cache: jax.Array,       # [N, B, Hkv, D], or [L, N, B, Hkv, D] with ``layer``
        v_cache: jax.Array | None,  # likewise; None: k_cache is fused rows [(L,) N, B, W]
        k_new: jax.Array,         # [T, Hkv, D]
        v_new: jax.Array,         # [T, Hkv, D]
        slot_mapping: jax.Array,  # int32 [T]  block_id * B + offset; -1 = skip
        layer: int | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    fused = v_cache is None
    num_blocks, block_size = k_cache.shape[-3:-1] if fused else k_cache.shape[-4:-2]
    if fused:
        return scatter_slots((k_cache,), (kv_layout.fuse(k_new, v_new),), slot_mapping,
                             num_blocks, block_size, layer)[0], None
    return scatter_slots((k_cache, v_cache), (k_new, v_new), slot_mapping, num_blocks,
                         block_size, layer)


def scatter_slots(caches: tuple, news: tuple, slot_mapping: jax.Array, num_blocks: int,
                  block_size: int, layer: int | None = None) -> tuple:
    """Each ``caches[i]`` ([(L,) N, B, ...]) with row t of ``news[i]`` ([T, ...]) written
    into slot ``slot_mapping[t]`` (of layer ``layer``; -1: skipped)."""
    num_slots = num_blocks * block_size
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)  # out of range: dropped
    if slots.shape[0] == 1:
        # XLA rewrites a one-row scatter into select(in range, dynamic-update-slice, cache),
        # which reads the whole cache twice and so cannot run in place: inside a decode
        # loop of one sequence it copied the cache every step. A second, dropped row keeps
        # it a scatter, which updates the donated cache in place.
        slots = jnp.concatenate([slots, jnp.full((1,), num_slots, slots.dtype)])
        news = tuple(jnp.concatenate([new, new]) for new in news)

    blocks, offsets = slots // block_size, slots % block_size  # slot num_slots: block N
    index = (blocks, offsets) if layer is None else (layer, blocks, offsets)
    return tuple(cache.at[index].set(new.astype(cache.dtype), mode="drop")
                 for cache, new in zip(caches, news))
