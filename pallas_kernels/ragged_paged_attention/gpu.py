"""Ragged paged attention for GPUs: Pallas with the Triton lowering.

Work decomposition (see ``tiling.py``): the grid is ``(query tile, kv head, kv split)``.
One program takes one tile (up to ``block_q`` new tokens of one sequence x the query
heads of one kv head, padded to a power of two) and streams that sequence's K/V pages
through the block table, ``pages_per_block`` pages per step, with an online softmax in
float32. Causal masking, the sliding window and the soft cap are applied per row; the
KV range a tile needs is computed from its positions, so a sliding window skips the
pages in front of it.

Decode-heavy batches have few tiles, too few to fill the chip; the KV range of each tile
is then split ``num_kv_splits`` ways (flash decoding). Every split writes its unnormalized
partial sum with its row max (in base-2 units: the kernel's softmax is exp2 of scores
scaled by log2(e)) and row sum, and one small Pallas kernel merges them
(``split_merge.py``; with ``merge_kernel=False``, or q / output tiled by XLA, XLA's
``combine_splits``: two kernels).

Layout: the public cache layout ``[num_blocks, block_size, num_kv_heads, head_dim]`` is
read as is: a BlockSpec selects the kv head, and a page of one head is ``block_size``
rows of ``head_dim`` contiguous elements (stride ``num_kv_heads * head_dim``), which the
Triton loads coalesce per row. Triton needs power-of-two tile shapes, so ``head_dim``
and ``block_size`` must be powers of two; the query group is padded to one.

Tuning (``gpu_config.py``): the KV tokens a loop step loads, the warps, the pipeline
stages, the programs wanted before splitting and the grid's order come from a table
measured per GPU (``scripts/tune_gpu_attention.py``); any of them can be given per call.
With ``heads_fastest`` the grid is ``(kv head, tile, split)``: the programs that run side
by side read the same pages' heads, which lie next to each other in the cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

import pallas_kernels.ragged_paged_attention.tiling as tiling
import pallas_kernels.ragged_paged_attention.half_products as in_halves
from pallas_kernels.kv_quant import decode, decode_in_integers
from pallas_kernels.kv_token_scale import token_scale_values_computed
from pallas_kernels._backend import has_fp8_units, runs_ptx
from pallas_kernels.ragged_paged_attention.gpu_config import (
    call_unsupported_reason, choose_blocks, config_for)
from pallas_kernels.ragged_paged_attention.ptx_math import LOG2E, exp2, scaled_exp2
from pallas_kernels.ragged_paged_attention.split_merge import call_outputs
from pallas_kernels.precision import dot_precision

def _kernel(seq_ref, pos0_ref, count_ref, kv_len_ref, start_ref,  # int32 [NT] each
            block_tables_ref,                          # int32 [S, M_pad]
            q_ref,                                     # [R, D] one tile, one kv head; direct:
                                                       #   [T * Hq, D], the whole of q
            k_ref, v_ref,                              # [N, B, D]  one kv head of the cache
            *refs,                                     # token scales: their codes' refs,
            #                                            uint8 [N, B] for k and v; then
            #   o_ref: like q_ref (f32 partial sum if split); with splits, f32 [R] / [T * Hq]
            #   row max and row sum refs
            sm_scale: float, soft_cap: float | None, sliding_window: int | None,
            rows: int, q_heads: int, group: int, group_padded: int, pages_per_block: int,
            num_splits: int, heads_fastest: bool, direct: bool, mask_split: bool,
            prefetch: bool, kv_format: str | None = None, fp8_in_integers: bool = False,
            token_scales: bool = False, halves: bool = False, int8_queries: bool = False,
            inline_ptx: bool = False):
    code_refs, (o_ref, *lm_refs) = (refs[:2], refs[2:]) if token_scales else ((), refs)
    tile, split = pl.program_id(1 if heads_fastest else 0), pl.program_id(2)
    kv_head = pl.program_id(0 if heads_fastest else 1)
    head_dim = q_ref.shape[-1]
    block_size = k_ref.shape[1]
    block_kv = pages_per_block * block_size

    seq = seq_ref[tile]
    pos0 = pos0_ref[tile]
    count = count_ref[tile]
    kv_len = kv_len_ref[tile]

    lo, hi = tiling.tile_kv_block_range(pos0, count, kv_len, sliding_window=sliding_window,
                                        block_kv=block_kv)
    table_blocks = block_tables_ref.shape[1] // pages_per_block  # never read past the table
    hi = jnp.minimum(hi, jnp.maximum(table_blocks, lo))
    per_split = pl.cdiv(hi - lo, num_splits)
    my_lo = jnp.minimum(lo + split * per_split, hi)
    my_hi = jnp.minimum(my_lo + per_split, hi)

    row = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    row_token = lax.div(row, group_padded)
    row_pos = pos0 + row_token                                   # [R] absolute position
    row_real = row_token < count
    if direct:  # this tile's rows of q, read in place: row (t, g) is q[start + t, h * G + g]
        row_head = lax.rem(row, group_padded)
        row_real &= row_head < group
        flat = (start_ref[tile] + row_token) * q_heads + kv_head * group + row_head  # [R]
        q = q_ref[jnp.where(row_real, flat, 0)]
        q = jnp.where(row_real[:, None], q, jnp.zeros_like(q))
        # where the output rows go: padding rows to spare rows past the real ones (their
        # stores are masked off; distinct rows keep interpret mode's scatter exact)
        spare = o_ref.shape[0] - rows
        flat = jnp.where(row_real, flat, spare + row)
        cols = lax.broadcasted_iota(jnp.int32, (rows, head_dim), 1)
        out_at = (flat[:, None], cols)
    else:
        q = q_ref[...]
    # The scores' scale includes log2(e) (base-2 units: the row maxima and the split
    # merge's too) so that the softmax's exponentials are exp2: one ex2.approx each, where
    # exp lowers to libdevice's expf (range reduction around its ex2: ~10 instructions a
    # score, more than a tile's other softmax work together). A soft cap needs natural
    # units: its tanh comes first.
    to_base2 = LOG2E if soft_cap is None else 1.0
    score_scale = sm_scale * to_base2
    if halves and not int8_queries:  # byte pages multiplied in float16 (``half_products``)
        q, row_scale = in_halves.queries_in_halves(q)                  # [R, D], [R]
        score_scale = (sm_scale * to_base2 * row_scale)[:, None]
    # what byte values become for the products with probabilities
    values_dtype = jnp.float16 if halves else q.dtype
    if int8_queries:  # each row as int8 codes of its own scale, times the int8 key codes
        q32 = q.astype(jnp.float32)
        q_step = jnp.maximum(jnp.max(jnp.abs(q32), axis=1), 1e-30) * (1.0 / 127.0)  # [R]
        # to the nearest code, ties up (Triton's lowering has no round-to-even)
        q = jnp.clip(jnp.floor(q32 / q_step[:, None] + 0.5), -127.0, 127.0).astype(jnp.int8)
        score_scale = (sm_scale * to_base2 * q_step)[:, None]
    num_pages = k_ref.shape[0]

    def load_block(j):  # [K, D] K and V of KV block j (as stored), then [K] scale codes
        j = jnp.minimum(j, table_blocks - 1)
        pages = block_tables_ref[seq, pl.ds(j * pages_per_block, pages_per_block)]
        pages = jnp.clip(pages, 0, num_pages - 1)   # table slots past the end may hold junk
        return (k_ref[pages].reshape(block_kv, head_dim),
                v_ref[pages].reshape(block_kv, head_dim),
                *(ref[pages].reshape(block_kv) for ref in code_refs))

    def body(j, carry, masked: bool):
        if prefetch:  # this block's pages came with the carry; the next one's load now,
            # ahead of the math (the last iteration reloads its own block: no new bytes)
            (m_prev, l_prev, acc_prev), block = carry[:3], carry[3:]
            block_next = load_block(jnp.maximum(jnp.minimum(j + 1, my_hi - 1), 0))
        else:
            m_prev, l_prev, acc_prev = carry
            block = load_block(j)
        k, v = block[:2]
        if kv_format is not None:  # byte pages (kv_quant): their values, in q's 16-bit
            # dtype, or float16 with half products (whatever q is then)
            if halves:  # float16, converted by inline PTX where that is cheaper
                convert = functools.partial(in_halves.bytes_in_halves, inline_ptx=inline_ptx,
                                            fp8_in_integers=fp8_in_integers)
            else:
                convert = functools.partial(
                    decode_in_integers if fp8_in_integers else decode, dtype=values_dtype)
            v = convert(v, kv_format)
            # int8 queries multiply the key bytes as the int8 codes they are: no conversion
            k = (lax.bitcast_convert_type(k, jnp.int8) if int8_queries
                 else convert(k, kv_format))
        # int8 queries: integer tensor cores, exact int32 sums of code products
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            precision=None if int8_queries else dot_precision(q.dtype),
                            preferred_element_type=jnp.int32 if int8_queries else jnp.float32)
        # [R, K] scores before their scale: it is applied after the row max (it is positive),
        # so that each exponent's argument is one fused multiply-add
        s = s.astype(jnp.float32)
        if token_scales:  # each key's own scale multiplies its scores (kv_token_scale)
            k_mul, v_mul = (token_scale_values_computed(codes) for codes in block[2:])  # [K]
            s = s * k_mul[None, :]
        scale = score_scale
        if soft_cap is not None:  # in natural units first, then base 2
            s = (soft_cap * LOG2E) * jnp.tanh(s * (score_scale / soft_cap))
            scale = 1.0
        if masked:
            col = j * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)   # [K]
            mask = ((col[None, :] <= row_pos[:, None]) & (col[None, :] < kv_len)
                    & row_real[:, None])
            if sliding_window is not None:
                mask &= col[None, :] > row_pos[:, None] - sliding_window
            s = jnp.where(mask, s, tiling.MASK_VALUE)
        max_scale = scale if isinstance(scale, float) else scale[:, 0]           # [R] or ()
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1) * max_scale)
        alpha = exp2(m_prev - m_next, inline_ptx)
        # float16 products: probabilities (and so the row sums) 2^PROBABILITY_EXPONENT times
        # their value, the scale taken in the exponent (acc / l divides it out)
        p_max = m_next - in_halves.PROBABILITY_EXPONENT if halves else m_next
        p = scaled_exp2(s, scale, p_max[:, None], inline_ptx)
        if masked:
            p = jnp.where(mask, p, 0.0)
            v = jnp.where((col < kv_len)[:, None], v, jnp.zeros_like(v))  # junk past the end
        l_next = alpha * l_prev + jnp.sum(p, axis=1)
        if token_scales:  # and each value's scale its probabilities, after the row sum
            p = p * v_mul[None, :]
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=dot_precision(v.dtype),
                             preferred_element_type=jnp.float32)     # [R, D]
        carry = (m_next, l_next, acc_prev * alpha[:, None] + pv)
        return carry + tuple(block_next) if prefetch else carry

    carry = (jnp.full((rows,), tiling.MASK_VALUE, jnp.float32),
             jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, head_dim), jnp.float32))
    if prefetch:
        carry += load_block(my_lo)
    if mask_split and sliding_window is None:
        # Blocks every real row sees whole (all their keys at or before the tile's first
        # position, so before kv_len too) skip the mask; padding rows there are zero
        # queries whose results are dropped. A decode tile's blocks are all such but its last.
        whole_hi = jnp.clip((pos0 + 1) // block_kv, my_lo, my_hi)
        carry = lax.fori_loop(my_lo, whole_hi, functools.partial(body, masked=False), carry)
    else:
        whole_hi = my_lo
    m, l, acc = lax.fori_loop(whole_hi, my_hi, functools.partial(body, masked=True), carry)[:3]

    if num_splits == 1:
        out = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
        if direct:  # each real row to its token's place; the others are not written
            plgpu.store(o_ref.at[out_at], out, mask=row_real[:, None])
        else:
            o_ref[...] = out
    else:
        m_ref, l_ref = lm_refs
        if direct:
            plgpu.store(o_ref.at[out_at], acc, mask=row_real[:, None])
            plgpu.store(m_ref.at[flat], m, mask=row_real)
            plgpu.store(l_ref.at[flat], l, mask=row_real)
        else:
            o_ref[...] = acc
            m_ref[...] = m
            l_ref[...] = l


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "interpret", "block_q", "block_kv",
    "num_kv_splits", "num_warps", "num_stages", "layer", "kv_format", "heads_fastest",
    "target_programs", "direct_io", "mask_split", "prefetch", "fp8_in_integers",
    "half_products", "int8_queries", "longest_first", "merge_kernel"))
def ragged_paged_attention_gpu(
        q: jax.Array,             # [T, Hq, D]
        k_cache: jax.Array,       # [N, B, Hkv, D], or [L, N, B, Hkv, D] with ``layer``
        v_cache: jax.Array,       # likewise
        kv_lens: jax.Array,       # int32 [S]
        block_tables: jax.Array,  # int32 [S, M]
        cu_q_lens: jax.Array,     # int32 [S + 1]
        num_seqs: jax.Array,      # int32 [1]
        *, sm_scale: float, sliding_window: int | None = None,
        soft_cap: float | None = None, interpret: bool = False,
        block_q: int | None = None, block_kv: int | None = None,
        num_kv_splits: int | None = None, num_warps: int | None = None,
        num_stages: int | None = None, layer: int | None = None,
        kv_format: str | None = None, heads_fastest: bool | None = None,
        target_programs: int | None = None, direct_io: bool | None = None,
        mask_split: bool | None = None,
        prefetch: bool | None = None,
        fp8_in_integers: bool | None = None,
        half_products: bool | None = None,
        longest_first: bool | None = None,
        merge_kernel: bool | None = None,
        int8_queries: bool = False,
        token_scales: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:  # [T, Hq, D]
    """The Pallas GPU (Triton) kernel; shapes are checked by the public function.
    ``kv_format``: the caches are bytes of that format, converted as pages load, with
    ``token_scales`` (codes [(L,) N, B, Hkv], keys and values; ``kv_token_scale``) read
    with their pages: key scales multiply scores, value scales probabilities.
    Tiling knobs left None come from ``gpu_config.config_for``. ``fp8_in_integers``: build
    e4m3 values from the bytes' fields (``kv_quant.decode_in_integers``); None: where the
    GPU has no FP8 conversion (compute capability < 8.9; never in interpret mode).
    ``half_products``: byte pages become float16 and are multiplied in float16
    (``half_products.py``: int8 and e5m2 through inline PTX, 1.25 and 0.5 instructions an
    element; 16-bit queries only), a tuning knob like the others. With ``int8_queries``
    it applies to the values only.
    ``int8_queries`` (int8 caches only; not a tuning knob, as it changes the results
    beyond rounding): each query row is rounded to int8 codes of its own scale (its
    largest |value| / 127) and multiplied by the key codes on integer tensor cores, with
    no conversion of the keys (values still convert). On SmolLM2 it cost 0.21 points of
    top-1 on held-out text (``scripts/bench_kv_scale_schemes.py``, ``+q8``)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape[-4:]
    max_num_seqs, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    compute_dtype = q.dtype if kv_format is not None else k_cache.dtype
    reason = call_unsupported_reason(q, k_cache, kv_format=kv_format, interpret=interpret)
    if reason:
        raise ValueError(reason)
    if int8_queries and kv_format != "int8":
        raise ValueError(f"int8_queries multiplies int8 key codes: it needs kv_format='int8', "
                         f"not {kv_format!r}")
    out_dtype = q.dtype
    config = config_for(decode=num_tokens <= max_num_seqs, kv_format=kv_format,
                        kv_itemsize=jnp.dtype(k_cache.dtype).itemsize,
                        compute_itemsize=jnp.dtype(compute_dtype).itemsize,
                        head_dim=head_dim, block_size=block_size,
                        group_padded=tiling.next_pow2(group), block_q=block_q,
                        block_kv=block_kv, num_warps=num_warps, num_stages=num_stages,
                        heads_fastest=heads_fastest, target_programs=target_programs,
                        direct_io=direct_io, mask_split=mask_split, prefetch=prefetch,
                        half_products=half_products, longest_first=longest_first,
                        merge_kernel=merge_kernel)
    block_q, group_padded, pages_per_block, splits = choose_blocks(
        num_tokens=num_tokens, max_num_seqs=max_num_seqs, group=group,
        block_size=block_size, max_blocks_per_seq=max_blocks, num_kv_heads=num_kv_heads,
        block_q=config.block_q, block_kv=config.block_kv, num_kv_splits=num_kv_splits,
        target_programs=config.target_programs)
    num_tiles = tiling.num_tiles_for(num_tokens, max_num_seqs, block_q)
    rows = block_q * group_padded

    tiles = tiling.build_tile_table(cu_q_lens, kv_lens, num_seqs, num_tokens=num_tokens,
                                    block_q=block_q, num_tiles=num_tiles)
    if config.longest_first:
        tiles = tiling.longest_first(tiles)
    direct = config.direct_io
    # byte pages multiplied in float16 (``half_products``): 16-bit queries only (float32
    # ones keep float32's products); int8 and e5m2 converted by inline PTX (on the device)
    halves = (config.half_products and kv_format in in_halves.FORMATS
              and jnp.dtype(q.dtype).itemsize == 2)
    q = q.astype(compute_dtype)
    if direct:  # the kernel gathers its rows of q and scatters its output rows itself
        q_in = q.reshape(num_tokens * num_q_heads, head_dim)
    else:
        q_in = tiling.tile_queries(q, tiles, num_kv_heads=num_kv_heads,
                                   group_padded=group_padded, block_q=block_q)
    padded_blocks = pl.cdiv(max_blocks, pages_per_block) * pages_per_block
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_blocks - max_blocks)))

    whole = pl.no_block_spec
    fastest = config.heads_fastest
    grid = (num_kv_heads, num_tiles, splits) if fastest else (num_tiles, num_kv_heads, splits)

    def ids(index_map):  # index maps take (tile, kv head, split) whatever the grid's order
        if fastest:
            return lambda h, t, s: index_map(t, h, s)
        return index_map

    if layer is None:
        cache_spec = pl.BlockSpec((num_blocks, block_size, None, head_dim),
                                  ids(lambda t, h, s: (0, 0, h, 0)))
        code_spec = pl.BlockSpec((num_blocks, block_size, None), ids(lambda t, h, s: (0, 0, h)))
    else:  # the layer's pages of the whole cache, selected by the BlockSpec: no copy
        cache_spec = pl.BlockSpec((None, num_blocks, block_size, None, head_dim),
                                  ids(lambda t, h, s: (layer, 0, 0, h, 0)))
        code_spec = pl.BlockSpec((None, num_blocks, block_size, None),
                                 ids(lambda t, h, s: (layer, 0, 0, h)))
    codes = tuple(token_scales or ())
    flat_rows = num_tokens * num_q_heads + rows  # + spare rows for a tile's padding rows
    if direct:
        q_spec = whole
        if splits == 1:
            out_shape = jax.ShapeDtypeStruct((flat_rows, head_dim), out_dtype)
            out_specs = whole
        else:
            out_shape = (jax.ShapeDtypeStruct((splits, flat_rows, head_dim), jnp.float32),
                         jax.ShapeDtypeStruct((splits, flat_rows), jnp.float32),
                         jax.ShapeDtypeStruct((splits, flat_rows), jnp.float32))
            out_specs = (pl.BlockSpec((None, flat_rows, head_dim),
                                      ids(lambda t, h, s: (s, 0, 0))),
                         pl.BlockSpec((None, flat_rows), ids(lambda t, h, s: (s, 0))),
                         pl.BlockSpec((None, flat_rows), ids(lambda t, h, s: (s, 0))))
    else:
        q_spec = pl.BlockSpec((None, None, rows, head_dim), ids(lambda t, h, s: (h, t, 0, 0)))
        if splits == 1:
            out_shape = jax.ShapeDtypeStruct(q_in.shape, out_dtype)
            out_specs = q_spec
        else:
            acc_shape = (splits, num_kv_heads, num_tiles, rows)
            out_shape = (jax.ShapeDtypeStruct(acc_shape + (head_dim,), jnp.float32),
                         jax.ShapeDtypeStruct(acc_shape, jnp.float32),
                         jax.ShapeDtypeStruct(acc_shape, jnp.float32))
            out_specs = (pl.BlockSpec((None, None, None, rows, head_dim),
                                      ids(lambda t, h, s: (s, h, t, 0, 0))),
                         pl.BlockSpec((None, None, None, rows),
                                      ids(lambda t, h, s: (s, h, t, 0))),
                         pl.BlockSpec((None, None, None, rows),
                                      ids(lambda t, h, s: (s, h, t, 0))))
    kernel = functools.partial(
        _kernel, sm_scale=float(sm_scale), soft_cap=soft_cap, sliding_window=sliding_window,
        rows=rows, q_heads=num_q_heads, group=group, group_padded=group_padded,
        pages_per_block=pages_per_block, num_splits=splits, heads_fastest=fastest,
        direct=direct, mask_split=config.mask_split, prefetch=config.prefetch,
        kv_format=kv_format, token_scales=bool(codes),
        # an A100's Triton has no FP8 conversion (a fatal compiler error): bytes to floats
        halves=halves, int8_queries=int8_queries,
        inline_ptx=not interpret and runs_ptx(),   # NVIDIA's GPUs (never ROCm's)
        fp8_in_integers=kv_format == "fp8_e4m3" and (
            not interpret and not has_fp8_units() if fp8_in_integers is None
            else fp8_in_integers))
    result = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole] * 6 + [q_spec, cache_spec, cache_spec] + [code_spec] * len(codes),
        out_specs=out_specs,
        out_shape=out_shape,
        # Triton's compiler params also select the Triton lowering (not Mosaic GPU).
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                             num_stages=config.num_stages),
        cost_estimate=tiling.cost_estimate(q.shape, k_cache.shape[-4:], block_tables.shape,
                                           jnp.dtype(k_cache.dtype).itemsize),
        interpret=interpret,
        name=(f"ragged_paged_attention_gpu_q{rows}_kv{pages_per_block * block_size}_s{splits}"
              f"_w{config.num_warps}_p{config.num_stages}{'_h' if fastest else ''}"
              f"{'_d' if direct else ''}{'_m' if config.mask_split else ''}"
              f"{'_f' if config.prefetch else ''}{'_f16' if halves else ''}"
              f"{'_q8' if int8_queries else ''}{'_r' if config.longest_first else ''}"),
    )(tiles.seq, tiles.pos0, tiles.count, tiles.kv_len, tiles.start, tables, q_in, k_cache,
      v_cache, *codes)
    return call_outputs(result, tiles=tiles, cu_q_lens=cu_q_lens, num_seqs=num_seqs,
                        num_tokens=num_tokens, q_heads=num_q_heads, block_q=block_q,
                        direct=direct, merge_kernel=config.merge_kernel, dtype=out_dtype,
                        interpret=interpret)
