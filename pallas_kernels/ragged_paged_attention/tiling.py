"""Query tiles: how the Pallas backends cut a ragged batch into fixed-size pieces of work.

A *tile* is up to ``block_q`` consecutive new tokens of ONE sequence, together with all
query heads that share ONE kv head (grouped-query attention). Its rows are
``row = token_in_tile * group_padded + head_in_group``, so one tile is a plain
``[block_q * group_padded, head_dim]`` matrix and one K/V page read serves every query
head of the group. ``group_padded >= group`` pads the group (to a power of two on the
GPU, where Triton wants power-of-two shapes); padded rows are zero and are dropped.

Everything here is plain jnp that runs before and after a kernel, on arrays the size of
the queries (never the cache):

- ``build_tile_table`` turns ``cu_q_lens`` / ``kv_lens`` / ``num_seqs`` into per-tile
  metadata (sequence, absolute position of the first token, token count, kv length) that
  the kernels read as scalars, and the inverse map token -> (tile, row);
- ``tile_queries`` gathers q into ``[num_kv_heads, num_tiles, rows, head_dim]``;
- ``untile_outputs`` gathers the kernel's tiles back to ``[num_tokens, num_q_heads,
  head_dim]`` and zeroes padding tokens;
- ``combine_splits`` merges flash-decoding partial results (one per KV split).

The number of tiles is static: a sequence with ``n`` new tokens needs ``ceil(n / block_q)``
tiles, so a batch of ``T`` token slots and ``S`` sequence slots never needs more than
``min(T, T // block_q + S)``. Unused tiles have ``count == 0`` and do no KV work.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels._backend import searchsorted_right
from pallas_kernels.ragged_paged_attention.reference import token_layout

# Logits of masked positions. Finite on purpose: -inf - (-inf) would make NaN in the
# online softmax of a row that has seen no key yet.
MASK_VALUE = -1e30


class TileTable(NamedTuple):
    seq: jax.Array         # int32 [num_tiles]  sequence of the tile (0 for an empty tile)
    pos0: jax.Array        # int32 [num_tiles]  absolute kv position of the tile's first token
    count: jax.Array       # int32 [num_tiles]  real tokens in the tile, 0..block_q (0 = empty)
    kv_len: jax.Array      # int32 [num_tiles]  kv_lens[seq] (0 for an empty tile)
    start: jax.Array       # int32 [num_tiles]  index in q of the tile's first token
    token_tile: jax.Array  # int32 [num_tokens] tile holding each token (0 for padding tokens)
    token_row: jax.Array   # int32 [num_tokens] token's place inside its tile
    token_valid: jax.Array  # bool [num_tokens] False for padding tokens


def next_pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def tile_kv_block_range(pos0, count, kv_len, *, sliding_window: int | None, block_kv: int):
    """[lo, hi): the KV blocks (of ``block_kv`` tokens) a query tile attends to.

    Causally up to its last real row (never past ``kv_len``), and with a sliding window
    from its first row's window start. Scalars in, scalars out; usable inside kernels.
    """
    end = jnp.where(count > 0, jnp.minimum(pos0 + count, kv_len), 0)
    begin = 0 if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    lo = begin // block_kv
    return lo, jnp.maximum((end + block_kv - 1) // block_kv, lo)


def num_tiles_for(num_tokens: int, max_num_seqs: int, block_q: int) -> int:
    """Static upper bound on the tiles a batch can need."""
    return max(1, min(num_tokens, num_tokens // block_q + max_num_seqs))


def build_tile_table(cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, *,
                     num_tokens: int, block_q: int, num_tiles: int) -> TileTable:
    max_num_seqs = kv_lens.shape[0]
    seq_ids = jnp.arange(max_num_seqs, dtype=jnp.int32)
    q_lens = jnp.where(seq_ids < num_seqs[0], cu_q_lens[1:] - cu_q_lens[:-1], 0)
    q_lens = jnp.maximum(q_lens, 0).astype(jnp.int32)                       # [S]
    tiles_per_seq = (q_lens + block_q - 1) // block_q
    cu_tiles = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                jnp.cumsum(tiles_per_seq).astype(jnp.int32)])  # [S + 1]

    t = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = searchsorted_right(cu_tiles[1:], t).astype(jnp.int32)
    seq = jnp.minimum(seq, max_num_seqs - 1)
    first = (t - cu_tiles[seq]) * block_q                     # offset among the seq's new tokens
    count = jnp.where(t < cu_tiles[-1], jnp.clip(q_lens[seq] - first, 0, block_q), 0)
    kv_len = jnp.where(count > 0, kv_lens[seq], 0).astype(jnp.int32)
    pos0 = jnp.where(count > 0, kv_len - q_lens[seq] + first, 0)
    start = cu_q_lens[seq] + first
    seq = jnp.where(count > 0, seq, 0)

    token_seq, _, valid = token_layout(cu_q_lens, kv_lens, num_seqs, num_tokens)
    offset = jnp.arange(num_tokens, dtype=jnp.int32) - cu_q_lens[token_seq]
    token_tile = jnp.clip(cu_tiles[token_seq] + offset // block_q, 0, num_tiles - 1)
    token_row = jnp.clip(offset % block_q, 0, block_q - 1)
    return TileTable(seq=seq, pos0=pos0.astype(jnp.int32), count=count.astype(jnp.int32),
                     kv_len=kv_len, start=start.astype(jnp.int32),
                     token_tile=jnp.where(valid, token_tile, 0).astype(jnp.int32),
                     token_row=jnp.where(valid, token_row, 0).astype(jnp.int32),
                     token_valid=valid)


def longest_first(tiles: TileTable) -> TileTable:
    """The same tiles in reverse order (tokens mapped to their tiles' new places).

    A sequence's later tiles attend to more keys, so a grid that walks the tiles in this
    order starts the long ones first and ends on short ones, instead of ending on the
    longest tiles of the last sequence while the rest of the chip idles (longest
    processing time first; causal prefill is where tiles differ most). Unused tiles
    (``count == 0``, no KV work) move to the front."""
    last = tiles.seq.shape[0] - 1
    return tiles._replace(seq=tiles.seq[::-1], pos0=tiles.pos0[::-1],
                          count=tiles.count[::-1], kv_len=tiles.kv_len[::-1],
                          start=tiles.start[::-1],
                          token_tile=jnp.where(tiles.token_valid, last - tiles.token_tile, 0))


def tile_queries(q: jax.Array, tiles: TileTable, *, num_kv_heads: int, group_padded: int,
                 block_q: int) -> jax.Array:
    """q [T, Hq, D] -> [Hkv, num_tiles, block_q * group_padded, D]; padding rows are zero."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    num_tiles = tiles.seq.shape[0]
    step = jnp.arange(block_q, dtype=jnp.int32)
    index = jnp.clip(tiles.start[:, None] + step[None], 0, num_tokens - 1)   # [NT, BQ]
    real = step[None] < tiles.count[:, None]                                 # [NT, BQ]
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    if group_padded > group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_padded - group), (0, 0)))
    x = jnp.where(real[:, :, None, None, None], qg[index], 0)               # [NT, BQ, Hkv, Gp, D]
    x = x.transpose(2, 0, 1, 3, 4)
    return x.reshape(num_kv_heads, num_tiles, block_q * group_padded, head_dim)


def untile_outputs(out: jax.Array, tiles: TileTable, *, num_q_heads: int, block_q: int,
                   dtype) -> jax.Array:
    """[Hkv, num_tiles, block_q * Gp, D] -> [T, Hq, D] in ``dtype``; padding tokens are zero."""
    num_kv_heads, num_tiles, rows, head_dim = out.shape
    group_padded = rows // block_q
    group = num_q_heads // num_kv_heads
    x = out.reshape(num_kv_heads, num_tiles, block_q, group_padded, head_dim)
    y = x[:, tiles.token_tile, tiles.token_row, :group]                      # [Hkv, T, G, D]
    y = y.transpose(1, 0, 2, 3).reshape(-1, num_q_heads, head_dim)
    return jnp.where(tiles.token_valid[:, None, None], y, 0).astype(dtype)


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array, *,
                   log2: bool = False) -> jax.Array:
    """Merge flash-decoding partials over axis 0.

    acc: f32 [splits, ..., D] unnormalized sums; m, l: f32 [splits, ...] row max and row sum.
    ``log2``: the row maxima are in base-2 units (each split's sums are relative to
    ``2^m``, not ``e^m``). Rows that saw no key anywhere (l == 0) come back as zeros.
    """
    m_all = jnp.max(m, axis=0)
    exp = jnp.exp2 if log2 else jnp.exp
    weight = exp(m - m_all[None])                                            # [splits, ...]
    l_all = jnp.sum(weight * l, axis=0)
    out = jnp.sum(weight[..., None] * acc, axis=0)
    return out / jnp.where(l_all > 0, l_all, 1.0)[..., None]


def cost_estimate(q_shape: tuple[int, ...], cache_shape: tuple[int, ...],
                  tables_shape: tuple[int, ...], itemsize: int):
    """What one attention call costs at most, for XLA's cost analysis (a Pallas call is
    opaque to it): every sequence slot reads every page its block-table row can hold, and
    every token attends over that whole context. Exact for full decode batches at the
    bucket's context; an upper bound otherwise (causal prefill reads less).
    """
    from jax.experimental import pallas as pl

    num_tokens, num_q_heads, head_dim = q_shape
    _, block_size, num_kv_heads, _ = cache_shape
    max_num_seqs, max_blocks = tables_shape
    context = max_blocks * block_size
    kv_bytes = 2 * max_num_seqs * context * num_kv_heads * head_dim * itemsize
    q_out_bytes = 2 * num_tokens * num_q_heads * head_dim * itemsize
    return pl.CostEstimate(flops=4 * num_tokens * num_q_heads * context * head_dim,
                           transcendentals=num_tokens * num_q_heads * context,
                           bytes_accessed=kv_bytes + q_out_bytes + 4 * max_num_seqs * max_blocks)
