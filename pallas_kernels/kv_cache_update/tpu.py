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

from pallas_kernels import kv_layout


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


# -- the fused layout (``kv_layout``): read, modify and write whole row groups ----------
#
# A fused cache ``[(L,) N, B, W]`` keeps the block's tokens in the tiled (second-minor)
# dimension, and a DMA cannot start inside an HBM tile: bfloat16 and byte rows are packed
# two or four to a 32-bit sublane ("Offsets along tiled dimensions must be aligned to
# tiles"). So each token's update reads the tile-aligned group of ``GROUP_ROWS`` rows
# holding its slot into VMEM, sets its row there and writes the group back. The tokens of
# one grid step that share a group all write the same merged group (each merges every
# such token's row), so the order of their writes does not matter; the step waits for
# its writes before the next step reads.
GROUP_ROWS = 8


def group_rows(block_size: int) -> int:
    """Rows per read-modify-write: the HBM tile's 8, or the whole page when the block
    size is not a multiple of 8."""
    return GROUP_ROWS if block_size % GROUP_ROWS == 0 else block_size


def _fused_kernel(slot_ref,              # SMEM int32 [T]   (prefetched)
                  rows_ref,              # VMEM f32 [P, W]  this step's new rows
                  kv_in_hbm,             # HBM [N, B, W] ([L, ...] with layer), aliased
                  kv_out_hbm,            # HBM, as the input
                  groups,                # VMEM [P, G, W]  each token's row group
                  sems,                  # DMA semaphores [2 (read, write), P]
                  *, tokens_per_step: int, layer: int | None, num_tokens: int):
    del kv_in_hbm
    num_blocks, block_size, _ = kv_out_hbm.shape[-3:]
    pages = kv_out_hbm if layer is None else kv_out_hbm.at[layer]
    rows_per_group = groups.shape[1]
    base = pl.program_id(0) * tokens_per_step

    targets = []  # per token of the step: (valid, page, first row of its group, row in it)
    for i in range(tokens_per_step):
        slot = slot_ref[jnp.minimum(base + i, num_tokens - 1)]
        valid = (base + i < num_tokens) & (slot >= 0) & (slot < num_blocks * block_size)
        slot = jnp.where(valid, slot, 0)
        page, offset = slot // block_size, slot % block_size
        first = pl.multiple_of(offset // rows_per_group * rows_per_group, rows_per_group)
        targets.append((valid, page, first, offset - first))

    def copy(i, direction):
        _, page, first, _ = targets[i]
        hbm = pages.at[page, pl.ds(first, rows_per_group)]
        if direction == 0:
            return pltpu.make_async_copy(hbm, groups.at[i], sems.at[0, i])
        return pltpu.make_async_copy(groups.at[i], hbm, sems.at[1, i])

    def each_valid(action, direction):
        for i in range(tokens_per_step):
            @pl.when(targets[i][0])
            def _():
                getattr(copy(i, direction), action)()

    each_valid("start", 0)
    each_valid("wait", 0)
    new_rows = rows_ref[...]                                            # [P, W]
    row = lax.broadcasted_iota(jnp.int32, groups.shape[1:], 0)          # [G, W]
    for i in range(tokens_per_step):
        _, page, first, _ = targets[i]
        group = groups[i]
        for j in range(tokens_per_step):
            valid_j, page_j, first_j, row_j = targets[j]
            same = valid_j & (page_j == page) & (first_j == first)
            group = jnp.where(same & (row == row_j),
                              new_rows[j:j + 1, :].astype(group.dtype), group)
        groups[i] = group
    each_valid("start", 1)
    each_valid("wait", 1)


@functools.partial(jax.jit, static_argnames=("interpret", "tokens_per_step", "layer"))
def kv_cache_update_fused_tpu(
        kv_cache: jax.Array,      # fused [N, B, W], or [L, N, B, W] with ``layer``
        v_cache: None,            # always None: the fused layout has one array
        k_new: jax.Array,         # [T, Hkv, D]
        v_new: jax.Array,         # [T, Hkv, D]
        slot_mapping: jax.Array,  # int32 [T]  block_id * B + offset; -1 = skip
        *, interpret: bool = False, tokens_per_step: int = 8,
        layer: int | None = None) -> tuple[jax.Array, None]:
    """The fused-layout update (see ``GROUP_ROWS``); the cache is aliased: in place."""
    del v_cache
    num_tokens = slot_mapping.shape[0]
    tokens_per_step = max(1, min(tokens_per_step, num_tokens))
    # float32 in VMEM (exact for bfloat16 and bytes): 8-row blocks of any dtype tile
    rows = kv_layout.fuse(k_new.astype(kv_cache.dtype), v_new).astype(jnp.float32)  # [T, W]
    padded = pl.cdiv(num_tokens, tokens_per_step) * tokens_per_step
    rows = jnp.pad(rows, ((0, padded - num_tokens), (0, 0)))
    block_size, width = kv_cache.shape[-2:]
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        functools.partial(_fused_kernel, tokens_per_step=tokens_per_step, layer=layer,
                          num_tokens=num_tokens),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(padded // tokens_per_step,),
            in_specs=[pl.BlockSpec((tokens_per_step, width), lambda t, *_: (t, 0)), hbm],
            out_specs=hbm,
            scratch_shapes=[pltpu.VMEM((tokens_per_step, group_rows(block_size), width),
                                       kv_cache.dtype),
                            pltpu.SemaphoreType.DMA((2, tokens_per_step))]),
        out_shape=jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
        # operand indices count the scalar-prefetch operand: 0 slots, 1 rows, 2 the cache
        input_output_aliases={2: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="kv_cache_update_fused_tpu",
    )(slot_mapping.astype(jnp.int32), rows, kv_cache)
    return out, None
