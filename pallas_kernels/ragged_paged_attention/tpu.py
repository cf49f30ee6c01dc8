"""Ragged paged attention for TPUs: Pallas Mosaic TPU with scalar prefetch and manual DMA.

The cache is in the fused layout (``pallas_kernels.kv_layout``): ``kv [N, B, W]`` (or
``[L, N, B, W]`` with ``layer``), one row of ``W`` lanes per token holding every KV head's
key and value. Given split ``(k_cache, v_cache)`` pages instead, the wrapper fuses them
first: a copy of the cache, for tests and explicit calls only (the engine allocates the
fused layout on TPUs, ``kv_layout.for_platform``).

Work decomposition (see ``tiling.py``): the grid is ``(query tile,)``. The tile table
(sequence, first position, token count, kv length per tile) and the flattened block
tables are *scalar-prefetched* into SMEM, so the kernel knows, before any vector work,
which pages each tile needs. The query tile arrives through an ordinary BlockSpec (VMEM,
pipelined by Pallas); the cache stays in HBM (``memory_space=ANY``) and the kernel copies
pages itself: ``pages_per_block`` whole pages ``kv[page]`` (``[B, W]``, contiguous, a
multiple of the HBM tile) per step into one half of a two-slot VMEM buffer, while the
previous step's pages are being used from the other half (double buffering with one DMA
semaphore per slot).

Each head reads its lanes of the buffer at offsets that are multiples of 128. With
``D > 64`` the key and the value are separate lane ranges of ``Dh`` lanes (q is padded
to ``Dh``). With ``D <= 64`` a head's key and value share one 128-lane group (key in
lanes 0-63, value in 64-127); q is padded to 128 lanes with zeros over the value half,
so ``q . group`` is exactly ``q . k``, and ``p . group`` carries ``p . v`` in lanes
64-127, which the wrapper keeps. Twice the matmul work for the small heads, and no lane
shuffles.

Byte pages (``kv_quant``) are converted to q's dtype as a head's lanes are read; an int8
page also carries each token's key and value scale codes in the parity of the value's
first 16 bytes (``kv_token_scale.embedded``): the kernel sums them out of the row (a
masked lane reduction per token and head) and multiplies each row of the converted key
and value by its token's scale.

Written for TPU interpret mode as well: no ref is reshaped or bitcast (JAX 0.10's TPU
interpreter cannot follow a reshaped ref), every ref access is a plain index or slice,
and the kernel runs on the CPU under ``interpret=pltpu.InterpretParams()``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_kernels.ragged_paged_attention.tiling as tiling
from pallas_kernels import kv_layout, kv_token_scale
from pallas_kernels.kv_quant import decode


def q_width(head_dim: int) -> int:
    """Lanes of a query (and output) row in the kernel: ``Dh``, or 128 when a head's key
    and value share one 128-lane group (``D <= 64``)."""
    half = kv_layout.half_width(head_dim)
    return 2 * half if half < kv_layout.LANES else half


def value_lane(head_dim: int) -> int:
    """The first lane of a head's value within the kernel's [.., q_width] output rows:
    its group's second half when key and value share one group, else 0."""
    half = kv_layout.half_width(head_dim)
    return half if half < kv_layout.LANES else 0


def _kernel(seq_ref, pos0_ref, count_ref, kv_len_ref,  # SMEM int32 [NT] each (prefetched)
            tables_ref,                                # SMEM int32 [S * M]   (prefetched)
            q_ref,                                     # VMEM [Hkv, R, Qw]  one tile
            kv_hbm,                                    # HBM [N, B, W] ([L, ...] w/ layer)
            o_ref,                                     # VMEM [Hkv, R, Qw]
            kv_buf,                                    # VMEM [2, K, W]  double buffer
            sems,                                      # DMA semaphores [2 (slot)]
            m_ref, l_ref, acc_ref,                     # VMEM f32 [Hkv, R, 1] x2, [Hkv, R, Qw]
            *, sm_scale: float, soft_cap: float | None, sliding_window: int | None,
            group_padded: int, pages_per_block: int, max_blocks_per_seq: int,
            layer: int | None, half: int, kv_format: str | None = None,
            embedded: bool = False):
    tile = pl.program_id(0)
    num_kv_heads, rows, width = q_ref.shape
    block_size = kv_hbm.shape[-2]
    pages = kv_hbm if layer is None else kv_hbm.at[layer]   # a leading, untiled index
    block_kv = pages_per_block * block_size
    slot_lanes = 2 * half                      # one head's key and value
    value_offset = 0 if width == slot_lanes else half   # from the key's first lane

    seq = seq_ref[tile]
    pos0 = pos0_ref[tile]
    count = count_ref[tile]
    kv_len = kv_len_ref[tile]

    lo, hi = tiling.tile_kv_block_range(pos0, count, kv_len, sliding_window=sliding_window,
                                        block_kv=block_kv)
    last_page = jnp.clip(pl.cdiv(kv_len, block_size) - 1, 0, max_blocks_per_seq - 1)

    def page_copies(j, slot):
        """The DMAs that bring KV block ``j`` (whole pages, every kv head) into ``slot``."""
        copies = []
        for p in range(pages_per_block):
            # Past the sequence's last page, re-read that page (masked out below) so that
            # every step issues the same number of copies and no junk table entry is used.
            page = tables_ref[seq * max_blocks_per_seq
                              + jnp.minimum(j * pages_per_block + p, last_page)]
            copies.append(pltpu.make_async_copy(
                pages.at[page], kv_buf.at[slot, pl.ds(p * block_size, block_size)],
                sems.at[slot]))
        return copies

    @pl.when(hi > lo)
    def _prefetch_first_block():
        for copy in page_copies(lo, 0):
            copy.start()

    m_ref[...] = jnp.full(m_ref.shape, tiling.MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    row_token = lax.broadcasted_iota(jnp.int32, (rows, block_kv), 0) // group_padded
    row_pos = pos0 + row_token                                          # [R, K]
    row_real = row_token < count

    def body(j, carry):
        slot = lax.rem(j - lo, 2)

        @pl.when(j + 1 < hi)
        def _prefetch_next_block():
            for copy in page_copies(j + 1, 1 - slot):
                copy.start()

        for copy in page_copies(j, slot):
            copy.wait()
        col = j * block_kv + lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
        mask = (col <= row_pos) & (col < kv_len) & row_real
        if sliding_window is not None:
            mask &= col > row_pos - sliding_window
        kv_col = j * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv, width), 0)

        def one_head(h, carry):
            """Online-softmax update of kv head ``h`` with its lanes of the pages."""
            first = pl.multiple_of(h * slot_lanes, KEY_ALIGN)
            k = kv_buf[slot, :, pl.ds(first, width)]                       # [K, Qw]
            v = k if value_offset == 0 else kv_buf[
                slot, :, pl.ds(pl.multiple_of(first + value_offset, KEY_ALIGN), width)]
            if embedded:  # int8 with each token's scale codes in its value bytes
                k, v = _token_scaled(k, v, value_offset == 0, half, q_ref.dtype)
            elif kv_format is not None:  # byte pages (kv_quant): their values, in q's dtype
                k, v = decode(k, kv_format, q_ref.dtype), decode(v, kv_format, q_ref.dtype)
            s = lax.dot_general(q_ref[h], k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(mask, s, tiling.MASK_VALUE)
            m_prev = m_ref[h]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))   # [R, 1]
            alpha = jnp.exp(m_prev - m_next)
            p = jnp.where(mask, jnp.exp(s - m_next), 0.0)
            l_ref[h] = alpha * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
            v = jnp.where(kv_col < kv_len, v.astype(jnp.float32), 0.0).astype(v.dtype)
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)            # [R, Qw]
            acc_ref[h] = acc_ref[h] * alpha + pv
            m_ref[h] = m_next
            return carry

        lax.fori_loop(0, num_kv_heads, one_head, 0)
        return carry

    lax.fori_loop(lo, hi, body, 0)
    l = l_ref[...]
    o_ref[...] = (acc_ref[...] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def _token_scaled(k, v, shared: bool, half: int, dtype):
    """A head's int8 key and value lanes uint8 [K, Qw] (one group holding both when
    ``shared``: key in lanes ``0..half``, value after) -> their values in ``dtype``, each
    token's row times its scale, whose codes ride in the parity of the value's first
    ``2 * EMBEDDED_BITS`` bytes (``kv_token_scale.encode_embedded``)."""
    first = half if shared else 0                       # the value's first lane in v
    values = lax.bitcast_convert_type(v, jnp.int8).astype(jnp.int32)
    lane = lax.broadcasted_iota(jnp.int32, values.shape, 1) - first
    bits = kv_token_scale.EMBEDDED_BITS
    weight = jnp.where((lane >= 0) & (lane < 2 * bits), 1 << (lane & (bits - 1)), 0)
    carried = (values & 1) * weight
    k_code = jnp.sum(jnp.where(lane < bits, carried, 0), axis=1, keepdims=True)   # [K, 1]
    v_code = jnp.sum(jnp.where(lane < bits, 0, carried), axis=1, keepdims=True)
    k_scale = kv_token_scale.token_scale_values_computed(k_code)                 # float32
    v_scale = kv_token_scale.token_scale_values_computed(v_code)
    if shared:  # one group: the key's lanes take the key's scale, the value's the value's
        scale = jnp.where(lane < 0, k_scale, v_scale).astype(dtype)
        k = decode(k, "int8", dtype) * scale
        return k, k
    return (decode(k, "int8", dtype) * k_scale.astype(dtype),
            values.astype(dtype) * v_scale.astype(dtype))


# Every head's lanes start on a multiple of this (its slot is 2 * Dh lanes, Dh 64 or a
# multiple of 128): the loads never cross a vreg's lanes unaligned.
KEY_ALIGN = 128

# Scoped VMEM the kernel may plan for. Mosaic's default scoped limit is 16 MiB on v5e,
# v6e and v5p; staying under 12 MiB leaves room for Mosaic's own temporaries.
VMEM_BUDGET = 12 * 2**20
LANES = 128


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def vmem_bytes(*, num_kv_heads: int, head_dim: int, rows: int, block_kv: int,
               itemsize: int, embedded: bool = False) -> int:
    """VMEM the kernel needs for one grid step, counted with TPU tile padding.

    A VMEM array's last two dimensions are stored in (sublane, 128-lane) tiles: the
    second-minor dimension rounds up to 8 rows of 32 bits (16 for bfloat16) and the
    minor one to 128 lanes. Counted: the two-slot page buffer ``[2, block_kv, W]`` (fused
    rows, ``kv_layout.row_width``), the q and output tiles ``[Hkv, rows, Qw]`` (each
    double-buffered by the Pallas pipeline), the float32 accumulator ``[Hkv, rows, Qw]``,
    the row max and sum ``[Hkv, rows, 1]``, a few ``[rows, block_kv]`` float32
    temporaries of the body (logits, probabilities, masks) and a head's key and value
    ``[block_kv, Qw]`` as float32 (masking, byte decoding), and with ``embedded`` two
    more of those (an int8 page's scale codes summed out of its value bytes,
    ``_token_scaled``).
    """
    sublanes = 8 * (4 // itemsize)
    width = q_width(head_dim)
    pages = 2 * _round_up(block_kv, sublanes) * kv_layout.row_width(num_kv_heads, head_dim) \
        * itemsize
    tiles = 2 * 2 * num_kv_heads * _round_up(rows, sublanes) * width * itemsize
    rows32 = _round_up(rows, 8)
    accumulators = num_kv_heads * rows32 * (width + 2 * LANES) * 4
    temporaries = 4 * rows32 * _round_up(block_kv, LANES) * 4 + 2 * block_kv * width * 4
    if embedded:
        temporaries += 2 * block_kv * width * 4
    return pages + tiles + accumulators + temporaries


def choose_blocks(*, num_tokens: int, max_num_seqs: int, group: int, block_size: int,
                  max_blocks_per_seq: int, num_kv_heads: int = 1, head_dim: int = 128,
                  itemsize: int = 4, block_q: int | None = None,
                  block_kv: int | None = None, embedded: bool = False
                  ) -> tuple[int, int, int]:
    """Static tiling: (block_q, group_padded, pages_per_block).

    Defaults: 8 query rows per kv head for decode-shaped batches, 128 for prefill-shaped
    ones, and 256 KV tokens per step; then, unless given, they are halved until
    ``vmem_bytes`` fits ``VMEM_BUDGET`` (many kv heads, float32): the KV step down to 128
    tokens, the query tile down to 8 rows, the KV step down to one page, and only then
    the query tile below 8 rows (fewer rows than one sublane tile waste the vector unit
    and the MXU).
    """
    group_padded = tiling.next_pow2(group)
    fixed_q, fixed_kv = block_q is not None, block_kv is not None
    if block_q is None:
        block_q = max(1, (8 if num_tokens <= max_num_seqs else 128) // group_padded)
    if block_kv is None:
        block_kv = 256
    pages_per_block = max(1, min(block_kv // block_size, max_blocks_per_seq))

    def fits() -> bool:
        return vmem_bytes(num_kv_heads=num_kv_heads, head_dim=head_dim,
                          rows=block_q * group_padded, block_kv=pages_per_block * block_size,
                          itemsize=itemsize, embedded=embedded) <= VMEM_BUDGET

    while not fits():
        rows = block_q * group_padded
        if not fixed_kv and pages_per_block > 1 and pages_per_block * block_size > 128:
            pages_per_block //= 2
        elif not fixed_q and block_q > 1 and rows > 8:
            block_q //= 2
        elif not fixed_kv and pages_per_block > 1:
            pages_per_block //= 2
        elif not fixed_q and block_q > 1:
            block_q //= 2  # under 8 rows: less than one sublane tile
        else:
            break  # the smallest tiling; the compiler has the last word
    return block_q, group_padded, pages_per_block


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "interpret", "block_q", "block_kv",
    "vmem_limit_bytes", "layer", "kv_format"))
def ragged_paged_attention_tpu(
        q: jax.Array,             # [T, Hq, D]
        k_cache: jax.Array,       # fused [N, B, W] ([L, N, B, W] with ``layer``), or split
        v_cache: jax.Array | None,  # None when fused; else [N, B, Hkv, D] like k_cache
        kv_lens: jax.Array,       # int32 [S]
        block_tables: jax.Array,  # int32 [S, M]
        cu_q_lens: jax.Array,     # int32 [S + 1]
        num_seqs: jax.Array,      # int32 [1]
        *, sm_scale: float, sliding_window: int | None = None,
        soft_cap: float | None = None, interpret: bool = False,
        block_q: int | None = None, block_kv: int | None = None,
        vmem_limit_bytes: int | None = None,
        layer: int | None = None, kv_format: str | None = None) -> jax.Array:  # [T, Hq, D]
    """The Pallas Mosaic TPU kernel; shapes are checked by the public function.

    ``interpret=True`` runs it in TPU interpret mode (``pltpu.InterpretParams()``), which
    also fills outputs and scratch buffers with NaN before the kernel runs.
    ``vmem_limit_bytes``: Mosaic's scoped VMEM limit (None: its default, 16 MiB on
    v5e/v6e/v5p); the tiling is sized for ``VMEM_BUDGET`` either way.
    ``kv_format``: the cache holds bytes of that format, converted as pages are used; a
    fused int8 cache carries each token's scale codes in its value bytes
    (``kv_token_scale.embedded``). Split caches are fused first (a copy of them; see the
    module docstring), and an int8 one then reads with its per-channel scales only.
    """
    embedded = kv_token_scale.embedded(kv_format, kv_layout.FUSED if v_cache is None
                                       else kv_layout.SPLIT)
    if v_cache is not None:
        k_cache = kv_layout.fuse(k_cache, v_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, width = k_cache.shape[-2:]
    num_kv_heads = kv_layout.heads_in_row(width, head_dim)
    max_num_seqs, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    itemsize = jnp.dtype(k_cache.dtype).itemsize
    block_q, group_padded, pages_per_block = choose_blocks(
        num_tokens=num_tokens, max_num_seqs=max_num_seqs, group=group,
        block_size=block_size, max_blocks_per_seq=max_blocks, num_kv_heads=num_kv_heads,
        head_dim=head_dim, itemsize=itemsize, block_q=block_q, block_kv=block_kv,
        embedded=embedded)
    num_tiles = tiling.num_tiles_for(num_tokens, max_num_seqs, block_q)
    rows = block_q * group_padded
    block_kv = pages_per_block * block_size
    lanes = q_width(head_dim)

    tiles = tiling.build_tile_table(cu_q_lens, kv_lens, num_seqs, num_tokens=num_tokens,
                                    block_q=block_q, num_tiles=num_tiles)
    compute_dtype = q.dtype if kv_format is not None else k_cache.dtype
    q_tiles = tiling.tile_queries(q.astype(compute_dtype), tiles, num_kv_heads=num_kv_heads,
                                  group_padded=group_padded, block_q=block_q)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, 0), (0, lanes - head_dim)))
    tile_spec = pl.BlockSpec((num_kv_heads, None, rows, lanes), lambda t, *_: (0, t, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(
        _kernel, sm_scale=float(sm_scale), soft_cap=soft_cap, sliding_window=sliding_window,
        group_padded=group_padded, pages_per_block=pages_per_block,
        max_blocks_per_seq=max_blocks, layer=layer, half=kv_layout.half_width(head_dim),
        kv_format=kv_format, embedded=embedded)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(num_tiles,),
            in_specs=[tile_spec, hbm],
            out_specs=tile_spec,
            scratch_shapes=[pltpu.VMEM((2, block_kv, width), k_cache.dtype),
                            pltpu.SemaphoreType.DMA((2,)),
                            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
                            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
                            pltpu.VMEM((num_kv_heads, rows, lanes), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct(q_tiles.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                             vmem_limit_bytes=vmem_limit_bytes),
        cost_estimate=tiling.cost_estimate(
            q.shape, (k_cache.shape[-3], block_size, num_kv_heads, head_dim),
            block_tables.shape, itemsize),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=f"ragged_paged_attention_tpu_q{rows}_kv{block_kv}",
    )(tiles.seq, tiles.pos0, tiles.count, tiles.kv_len,
      block_tables.astype(jnp.int32).reshape(-1), q_tiles, k_cache)
    first = value_lane(head_dim)
    out = out[..., first:first + head_dim]
    return tiling.untile_outputs(out, tiles, num_q_heads=num_q_heads, block_q=block_q,
                                 dtype=q.dtype)
