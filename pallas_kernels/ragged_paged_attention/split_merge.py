"""What the GPU attention kernel's rows become: flash decoding's split merge as one Pallas
(Triton) kernel, and ``call_outputs``, the attention call's output from the kernel's.

When a batch alone does not fill the GPU (decode), the attention kernel splits each
tile's KV range over ``splits`` programs; each writes, for its rows, the unnormalized sum
of its keys' values, its row max (base-2 units) and its row sum. ``tiling.combine_splits``
merges them in XLA, which XLA:GPU compiles to two kernels (the maxima and each split's
weight, then the weighted sums with the conversion to the output dtype and the padding
tokens' rows zeroed): in a decode step, two launches a layer, each a few microseconds of
launch and tail around a few kilobytes of work. ``merge_splits`` does all of it in one.

Rows are the kernel's in-place rows (``direct_io``): row ``token * Hq + head``. The
partials of rows no program wrote (padding tokens) hold whatever the buffer held, NaN
included; those rows come back zero, selected, never multiplied. A row whose splits all
saw no key (row sum 0) comes back zero too, as ``combine_splits`` makes it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention import tiling
from pallas_kernels.ragged_paged_attention.tiling import MASK_VALUE

MAX_BLOCK_ROWS = 16  # rows a program merges: 16 x head_dim 128 floats over 4 warps


def block_rows_for(num_rows: int) -> int:
    """Rows a program merges: the largest power of two up to ``MAX_BLOCK_ROWS`` that
    divides ``num_rows`` (so the programs cover the rows exactly, with no padded output
    to slice off; Triton wants power-of-two blocks)."""
    return min(MAX_BLOCK_ROWS, num_rows & -num_rows)


def _kernel(cu_q_lens_ref,      # int32 [S + 1]
            num_seqs_ref,       # int32 [1]
            acc_ref,            # f32 [splits, R_all, D]  unnormalized sums
            m_ref, l_ref,       # f32 [splits, R_all]  row max (base 2) and row sum
            o_ref,              # [num_rows, D]
            *, splits: int, block_rows: int, q_heads: int):
    first = pl.program_id(0) * block_rows
    # rows of real tokens, read here (in XLA it would be one more kernel)
    valid_rows = cu_q_lens_ref[num_seqs_ref[0]] * q_heads
    rows = pl.ds(first, block_rows)
    head_dim = o_ref.shape[1]

    def merge(s, carry):  # the running (max, sum of values, sum of weights) and split s
        m, num, den = carry
        m_s, l_s = m_ref[s, rows], l_ref[s, rows]                           # [RB]
        m_next = jnp.maximum(m, m_s)
        old, new = jnp.exp2(m - m_next), jnp.exp2(m_s - m_next)              # [RB]
        return (m_next, num * old[:, None] + acc_ref[s, rows, :] * new[:, None],
                den * old + l_s * new)

    carry = (jnp.full((block_rows,), MASK_VALUE, jnp.float32),
             jnp.zeros((block_rows, head_dim), jnp.float32),
             jnp.zeros((block_rows,), jnp.float32))
    _, num, den = lax.fori_loop(0, splits, merge, carry)
    row = first + lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
    keep = (row < valid_rows) & (den > 0)                                    # [RB]
    out = num / jnp.where(keep, den, 1.0)[:, None]
    o_ref[rows, :] = jnp.where(keep[:, None], out, 0.0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("num_rows", "q_heads", "dtype", "interpret"))
def merge_splits(acc: jax.Array,         # f32 [splits, R_all, D], R_all >= num_rows
                 m: jax.Array,           # f32 [splits, R_all]  base-2 row maxima
                 l: jax.Array,           # f32 [splits, R_all]
                 cu_q_lens: jax.Array,   # int32 [S + 1]  the attention call's
                 num_seqs: jax.Array,    # int32 [1]
                 *, num_rows: int, q_heads: int, dtype,
                 interpret: bool = False) -> jax.Array:
    """The merged, normalized rows ``[num_rows, D]`` (row ``token * q_heads + head``) in
    ``dtype``; the rows of padding tokens (at or past ``cu_q_lens[num_seqs[0]]``) are zero.
    Equals ``combine_splits(acc, m, l, log2=True)[:num_rows]`` with those rows zeroed, up
    to float32 rounding (the splits are merged one after another, not all at once)."""
    splits, _, head_dim = acc.shape
    block_rows = block_rows_for(num_rows)
    whole = pl.no_block_spec
    return pl.pallas_call(
        functools.partial(_kernel, splits=splits, block_rows=block_rows, q_heads=q_heads),
        grid=(num_rows // block_rows,),
        in_specs=[whole] * 5,
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((num_rows, head_dim), dtype),
        # Triton's compiler params also select the Triton lowering (not Mosaic GPU).
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name=f"merge_attention_splits_s{splits}_r{block_rows}",
    )(cu_q_lens.astype(jnp.int32), num_seqs.astype(jnp.int32), acc, m, l)


def call_outputs(result, *, tiles: tiling.TileTable, cu_q_lens: jax.Array,
                 num_seqs: jax.Array, num_tokens: int, q_heads: int, block_q: int,
                 direct: bool, merge_kernel: bool, dtype, interpret: bool) -> jax.Array:
    """The attention call's ``[T, Hq, D]`` in ``dtype`` from the kernel's ``result``: its
    rows (one split), or ``(acc, m, l)`` of its splits. Read in place (``direct``) the
    splits are merged by ``merge_splits`` (with ``merge_kernel``) or XLA's
    ``combine_splits``; tiled by XLA they are merged by XLA and gathered back. Padding
    tokens' rows, never written, come back zero."""
    split = isinstance(result, tuple)
    head_dim = (result[0] if split else result).shape[-1]
    if direct and split and merge_kernel:  # one kernel: merge, convert, zero
        out = merge_splits(*result, cu_q_lens, num_seqs, num_rows=num_tokens * q_heads,
                           q_heads=q_heads, dtype=dtype, interpret=interpret)
        return out.reshape(num_tokens, q_heads, head_dim)
    out = tiling.combine_splits(*result, log2=True) if split else result
    if not direct:
        return tiling.untile_outputs(out, tiles, num_q_heads=q_heads, block_q=block_q,
                                     dtype=dtype)
    # one elementwise pass, fused with XLA's split merge when there is one
    valid = jnp.arange(num_tokens, dtype=jnp.int32) < cu_q_lens[num_seqs[0]]      # [T]
    out = out[:num_tokens * q_heads].reshape(num_tokens, q_heads, head_dim)
    return jnp.where(valid[:, None, None], out, 0).astype(dtype)
