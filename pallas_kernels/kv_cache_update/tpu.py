"""KV cache update for TPUs: Pallas Mosaic TPU, one DMA per new token and per K/V.

The slot mapping is scalar-prefetched into SMEM. New keys/values and the caches stay in
HBM (``memory_space=ANY``); each grid step takes ``tokens_per_step`` tokens, starts an
HBM -> HBM copy of ``k_new[t]`` (``[num_kv_heads, head_dim]``) into
``k_cache[slot // block_size, slot % block_size]`` for every token whose slot is not -1,
then waits for all of them. Only leading (untiled) dimensions are indexed, so no copy
splits a TPU memory tile. The caches are aliased to the outputs: the update is in place.

Runs on the CPU under ``interpret=pltpu.InterpretParams()`` (no ref reshapes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _kernel(slot_ref,                  # SMEM int32 [T]   (prefetched)
            k_new_hbm, v_new_hbm,      # HBM [T, Hkv, D]
            k_in_hbm, v_in_hbm,        # HBM [N, B, Hkv, D] ([L, ...] with layer), aliased
            k_out_hbm, v_out_hbm,      # HBM, as the inputs
            sems,                      # DMA semaphores [2]
            *, tokens_per_step: int, layer: int | None):
    del k_in_hbm, v_in_hbm
    num_tokens = k_new_hbm.shape[0]
    num_blocks, block_size = k_out_hbm.shape[-4:-2]
    if layer is not None:  # a leading, untiled index: the layer's pages
        k_out_hbm, v_out_hbm = k_out_hbm.at[layer], v_out_hbm.at[layer]
    base = pl.program_id(0) * tokens_per_step

    def copies(i):
        token = jnp.minimum(base + i, num_tokens - 1)
        slot = slot_ref[token]
        valid = (base + i < num_tokens) & (slot >= 0) & (slot < num_blocks * block_size)
        slot = jnp.where(valid, slot, 0)
        page, offset = slot // block_size, slot % block_size
        return valid, (
            pltpu.make_async_copy(k_new_hbm.at[token], k_out_hbm.at[page, offset], sems.at[0]),
            pltpu.make_async_copy(v_new_hbm.at[token], v_out_hbm.at[page, offset], sems.at[1]))

    def each_valid_copy(action: str):
        """A loop body calling ``action`` ("start" or "wait") on token i's K and V copies."""
        def body(i, carry):
            valid, pair = copies(i)

            @pl.when(valid)
            def _():
                for copy in pair:
                    getattr(copy, action)()
            return carry
        return body

    lax.fori_loop(0, tokens_per_step, each_valid_copy("start"), 0)  # all DMAs in flight,
    lax.fori_loop(0, tokens_per_step, each_valid_copy("wait"), 0)   # then wait for each


@functools.partial(jax.jit, static_argnames=("interpret", "tokens_per_step", "layer"))
def kv_cache_update_tpu(
        k_cache: jax.Array,       # [N, B, Hkv, D], or [L, N, B, Hkv, D] with ``layer``
        v_cache: jax.Array,       # likewise
        k_new: jax.Array,         # [T, Hkv, D]
        v_new: jax.Array,         # [T, Hkv, D]
        slot_mapping: jax.Array,  # int32 [T]  block_id * B + offset; -1 = skip
        *, interpret: bool = False, tokens_per_step: int = 32,
        layer: int | None = None) -> tuple[jax.Array, jax.Array]:
    num_tokens = slot_mapping.shape[0]
    tokens_per_step = max(1, min(tokens_per_step, num_tokens))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_kernel, tokens_per_step=tokens_per_step, layer=layer),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(pl.cdiv(num_tokens, tokens_per_step),),
            in_specs=[hbm, hbm, hbm, hbm],
            out_specs=(hbm, hbm),
            scratch_shapes=[pltpu.SemaphoreType.DMA((2,))]),
        out_shape=(jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)),
        # Operand indices count the scalar-prefetch operand: 0 slots, 1-2 new, 3-4 caches.
        input_output_aliases={3: 0, 4: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="kv_cache_update_tpu",
    )(slot_mapping.astype(jnp.int32), k_new.astype(k_cache.dtype),
      v_new.astype(v_cache.dtype), k_cache, v_cache)
