"""KV cache update for GPUs: Pallas with the Triton lowering.

One program per new token: it reads the token's slot and, unless the slot is -1 (or
out of range), stores the token's ``[num_kv_heads, head_dim]`` keys and values into that
slot, one head row at a time. The caches are aliased to the outputs, so the update is in
place: slots nobody writes keep their contents (donate the caches to avoid XLA's copy).

The cache is viewed as ``[num_blocks * block_size, num_kv_heads, head_dim]`` (merging the
two leading dimensions is free); ``head_dim`` must be a power of two (Triton).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _kernel(slot_ref,                  # int32 [T]
            k_new_ref, v_new_ref,      # [T, Hkv, D]
            k_in_ref, v_in_ref,        # [N * B, Hkv, D]  aliased to the outputs, unused
            k_out_ref, v_out_ref):     # [N * B, Hkv, D]
    del k_in_ref, v_in_ref
    token = pl.program_id(0)
    slot = slot_ref[token]
    num_slots, num_kv_heads, _ = k_out_ref.shape

    @pl.when((slot >= 0) & (slot < num_slots))
    def _write():
        for head in range(num_kv_heads):
            k_out_ref[slot, head, :] = k_new_ref[token, head, :].astype(k_out_ref.dtype)
            v_out_ref[slot, head, :] = v_new_ref[token, head, :].astype(v_out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "layer"))
def kv_cache_update_gpu(
        k_cache: jax.Array,       # [N, B, Hkv, D], or [L, N, B, Hkv, D] with ``layer``
        v_cache: jax.Array,       # likewise
        k_new: jax.Array,         # [T, Hkv, D]
        v_new: jax.Array,         # [T, Hkv, D]
        slot_mapping: jax.Array,  # int32 [T]  block_id * B + offset; -1 = skip
        *, interpret: bool = False, layer: int | None = None) -> tuple[jax.Array, jax.Array]:
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape[-4:]
    if head_dim & (head_dim - 1):
        raise ValueError(f"the Pallas GPU kernel needs a power-of-two head_dim, got {head_dim}")
    # GPU arrays are row-major, so viewing every layer's slots as one flat axis is free.
    num_layers = 1 if layer is None else k_cache.shape[0]
    flat = (num_layers * num_blocks * block_size, num_kv_heads, head_dim)
    if layer is not None:
        layer_slots = num_blocks * block_size  # out of the layer's range: skipped
        slot_mapping = jnp.where((slot_mapping < 0) | (slot_mapping >= layer_slots), -1,
                                 slot_mapping + layer * layer_slots)
    num_tokens = slot_mapping.shape[0]
    k_out, v_out = pl.pallas_call(
        _kernel,
        grid=(num_tokens,),
        out_shape=(jax.ShapeDtypeStruct(flat, k_cache.dtype),
                   jax.ShapeDtypeStruct(flat, v_cache.dtype)),
        input_output_aliases={3: 0, 4: 1},
        # Triton's compiler params also select the Triton lowering (not Mosaic GPU).
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="kv_cache_update_gpu",
    )(slot_mapping.astype("int32"), k_new, v_new, k_cache.reshape(flat), v_cache.reshape(flat))
    return k_out.reshape(k_cache.shape), v_out.reshape(v_cache.shape)
