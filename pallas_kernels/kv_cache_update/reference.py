"""Plain-jnp KV cache update: scatter new keys/values into their flat slots."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def kv_cache_update_reference(
        k_cache: jax.Array,       # [N, B, Hkv, D]
        v_cache: jax.Array,       # [N, B, Hkv, D]
        k_new: jax.Array,         # [T, Hkv, D]
        v_new: jax.Array,         # [T, Hkv, D]
        slot_mapping: jax.Array,  # int32 [T]  block_id * B + offset; -1 = skip
) -> tuple[jax.Array, jax.Array]:
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_slots = num_blocks * block_size
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)  # out of range: dropped

    def scatter(cache: jax.Array, new: jax.Array) -> jax.Array:
        flat = cache.reshape(num_slots, num_kv_heads, head_dim)
        flat = flat.at[slots].set(new.astype(cache.dtype), mode="drop")
        return flat.reshape(cache.shape)

    return scatter(k_cache, k_new), scatter(v_cache, v_new)
