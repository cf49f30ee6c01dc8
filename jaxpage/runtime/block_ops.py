"""Whole-block KV operations on the device: copy-on-write copies and host swapping.

Index lists are padded to a power of two so each function compiles for few shapes
(``programs``, an ExecutableCache, keeps them compiled across starts);
padding entries point at the null block 0 (a copy 0 -> 0, or zeros written to block 0),
which is never read unmasked.
"""

from __future__ import annotations

from functools import partial

import jax
import numpy as np

KVCache = tuple[jax.Array, jax.Array]  # each [num_layers, num_blocks, block_size, kv_heads, head_dim]

# The most K+V bytes one swap program moves: larger swaps run as several calls. A gather
# or scatter's temporaries grow with its block count (on TPUs, several times the blocks'
# bytes: the blocks are re-tiled), so an unbounded bucket (every block of the cache at
# once) would not fit next to the cache it copies.
SWAP_CHUNK_BYTES = 128 * 2**20


def swap_chunk(block_bytes: int) -> int:
    """Blocks per swap call: the largest power of two whose K+V bytes (``block_bytes``
    per block, K and V together) fit in ``SWAP_CHUNK_BYTES``, at least 1."""
    most = max(1, SWAP_CHUNK_BYTES // max(1, block_bytes))
    return 1 << (most.bit_length() - 1)


def padded(ids: list[int]) -> np.ndarray:
    """int32 ids padded with 0 to the next power of two (at least 1)."""
    size = 1 << max(0, (len(ids) - 1).bit_length())
    out = np.zeros(size, np.int32)
    out[:len(ids)] = ids
    return out


@partial(jax.jit, donate_argnums=(0,))
def copy_blocks(kv: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """Block dst[i] <- block src[i] in every layer. src, dst: int32 [P]."""
    k, v = kv
    return k.at[:, dst].set(k[:, src]), v.at[:, dst].set(v[:, src])


@jax.jit
def gather_blocks(kv: KVCache, ids: jax.Array) -> KVCache:
    """(k, v) of blocks ``ids``, each [num_layers, P, block_size, kv_heads, head_dim]."""
    k, v = kv
    return k[:, ids], v[:, ids]


@partial(jax.jit, donate_argnums=(0,))
def scatter_blocks(kv: KVCache, ids: jax.Array, k_blocks: jax.Array, v_blocks: jax.Array) -> KVCache:
    k, v = kv
    return k.at[:, ids].set(k_blocks.astype(k.dtype)), v.at[:, ids].set(v_blocks.astype(v.dtype))


def run_program(programs, function, *args):
    """``function(*args)``, through the executable cache when one is given (keyed by the
    padded index count, the only shape that varies)."""
    if programs is None:
        return function(*args)
    bucket = tuple(args[1].shape)
    return programs.get(function.__name__, bucket, function, args)(*args)


class HostKVPool:
    """Host-memory copies of swapped-out blocks: (k, v), each [num_host_blocks, layers, ...]."""

    def __init__(self, num_blocks: int, block_shape: tuple[int, ...], dtype) -> None:
        # np.empty only reserves address space; pages are committed when a swap writes them.
        self.k = np.empty((num_blocks, *block_shape), dtype)
        self.v = np.empty((num_blocks, *block_shape), dtype)
        # blocks per swap program call (``swap_chunk``)
        self.chunk = swap_chunk(2 * int(np.prod(block_shape)) * np.dtype(dtype).itemsize)


def _chunks(pairs: list[tuple[int, int]], size: int):
    for start in range(0, len(pairs), size):
        yield pairs[start:start + size]


def swap_out(kv: KVCache, host: HostKVPool, pairs: list[tuple[int, int]],
             programs=None) -> None:
    """Copy device blocks to host slots: pairs of (device block, host block)."""
    if len(pairs) > host.chunk:
        for part in _chunks(pairs, host.chunk):
            swap_out(kv, host, part, programs)
        return
    if not pairs:
        return
    device_ids, host_ids = zip(*pairs)
    k_blocks, v_blocks = jax.device_get(
        run_program(programs, gather_blocks, kv, jax.device_put(padded(list(device_ids)))))
    n = len(pairs)
    host.k[list(host_ids)] = np.moveaxis(k_blocks, 1, 0)[:n]
    host.v[list(host_ids)] = np.moveaxis(v_blocks, 1, 0)[:n]


def swap_in(kv: KVCache, host: HostKVPool, pairs: list[tuple[int, int]],
            programs=None) -> KVCache:
    """Copy host slots back into device blocks: pairs of (host block, device block)."""
    if len(pairs) > host.chunk:
        for part in _chunks(pairs, host.chunk):
            kv = swap_in(kv, host, part, programs)
        return kv
    if not pairs:
        return kv
    host_ids, device_ids = zip(*pairs)
    ids = padded(list(device_ids))
    k_blocks = np.zeros((len(ids), *host.k.shape[1:]), host.k.dtype)
    v_blocks = np.zeros_like(k_blocks)
    k_blocks[:len(pairs)] = host.k[list(host_ids)]
    v_blocks[:len(pairs)] = host.v[list(host_ids)]
    return run_program(programs, scatter_blocks, kv, jax.device_put(ids),
                jax.device_put(np.moveaxis(k_blocks, 0, 1)),
                jax.device_put(np.moveaxis(v_blocks, 0, 1)))


def copy(kv: KVCache, pairs: list[tuple[int, int]], programs=None) -> KVCache:
    """Copy-on-write copies: pairs of (src block, dst block), applied in order."""
    if not pairs:
        return kv
    src, dst = zip(*pairs)
    return run_program(programs, copy_blocks, kv, jax.device_put(padded(list(src))),
                jax.device_put(padded(list(dst))))
