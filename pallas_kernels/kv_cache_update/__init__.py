"""Public KV cache update: validates shapes, then scatters (slot -1 is skipped)."""

from __future__ import annotations

import jax

from pallas_kernels.kv_cache_update.reference import kv_cache_update_reference


def kv_cache_update(k_cache, v_cache, k_new, v_new, slot_mapping) -> tuple[jax.Array, jax.Array]:
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, "
                         f"num_kv_heads, head_dim], got {k_cache.shape} and {v_cache.shape}")
    expected = (slot_mapping.shape[0],) + k_cache.shape[2:]
    if k_new.shape != expected or v_new.shape != expected:
        raise ValueError(f"k_new/v_new must be {expected} (num_tokens, num_kv_heads, head_dim), "
                         f"got {k_new.shape} and {v_new.shape}")
    if slot_mapping.ndim != 1:
        raise ValueError(f"slot_mapping must be 1-D, got shape {slot_mapping.shape}")
    return kv_cache_update_reference(k_cache, v_cache, k_new, v_new, slot_mapping)


__all__ = ["kv_cache_update", "kv_cache_update_reference"]
