"""Whole-block KV operations on the device: copy-on-write copies and host swapping.

One program, ``move_blocks``, does all three: it reads blocks ``src`` (returned, for a
swap-out) and writes blocks ``dst`` with either what it read (a copy) or blocks from the
host (a swap-in). One program kind instead of three keeps the engine's program set small
(``jaxpage.core.program_set``: the set compiled before an engine is ready holds one block
program, of the largest size, which every move can run padded).

Index lists are padded to a rung of ``move_sizes`` (1, 4, 16, ... up to the swap chunk);
padding entries point at the null block 0 (reads of block 0, writes into block 0), which
is never read unmasked. Longer lists run as several calls of at most the chunk.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

KVCache = tuple[jax.Array, jax.Array]  # each [num_layers, num_blocks, block_size, kv_heads, head_dim]

# The most K+V bytes one block-move call moves: larger moves run as several calls. A
# gather or scatter's temporaries grow with its block count (on TPUs, several times the
# blocks' bytes: the blocks are re-tiled), so an unbounded bucket (every block of the
# cache at once) would not fit next to the cache it copies.
SWAP_CHUNK_BYTES = 128 * 2**20
# Growth of the block-move sizes: 1, 4, 16, ... (each size is a compiled program).
MOVE_SIZE_GROWTH = 4


def swap_chunk(block_bytes: int) -> int:
    """Blocks per swap call: the largest power of two whose K+V bytes (``block_bytes``
    per block, K and V together) fit in ``SWAP_CHUNK_BYTES``, at least 1."""
    most = max(1, SWAP_CHUNK_BYTES // max(1, block_bytes))
    return 1 << (most.bit_length() - 1)


def move_chunk(block_bytes: int, num_blocks: int) -> int:
    """Blocks per block-move call: ``swap_chunk``, but no more than the power of two that
    holds every block of the cache (``num_blocks``, the null block included)."""
    return min(swap_chunk(block_bytes), 1 << max(0, (num_blocks - 1).bit_length()))


def move_sizes(chunk: int) -> list[int]:
    """The padded sizes of ``move_blocks`` calls: powers of ``MOVE_SIZE_GROWTH`` below
    ``chunk``, then ``chunk`` itself (every list of at most ``chunk`` fits one)."""
    sizes, size = [], 1
    while size < chunk:
        sizes.append(size)
        size *= MOVE_SIZE_GROWTH
    return sizes + [chunk]


def padded(ids: list[int], sizes: list[int] | None = None) -> np.ndarray:
    """int32 ids padded with 0 to the smallest of ``sizes`` that holds them (default: the
    next power of two, at least 1)."""
    if sizes is None:
        size = 1 << max(0, (len(ids) - 1).bit_length())
    else:
        size = next(s for s in sizes if s >= len(ids))
    out = np.zeros(size, np.int32)
    out[:len(ids)] = ids
    return out


@partial(jax.jit, donate_argnums=(0,))
def move_blocks(kv: KVCache, src: jax.Array, dst: jax.Array, k_in: jax.Array, v_in: jax.Array,
                from_input: jax.Array) -> tuple[KVCache, KVCache]:
    """Read blocks ``src`` (int32 [P]) of every layer, then write blocks ``dst`` (int32
    [P]) with ``k_in`` / ``v_in`` (each [num_layers, P, block_size, kv_heads, head_dim])
    when ``from_input`` (bool []), else with the blocks just read (a copy ``src[i] ->
    dst[i]``). Returns (the cache, the blocks read, before any write). No conditional:
    the choice is an elementwise select, so no platform waits on it."""
    k, v = kv
    k_out, v_out = k[:, src], v[:, src]
    k_new = jnp.where(from_input, k_in.astype(k.dtype), k_out)
    v_new = jnp.where(from_input, v_in.astype(v.dtype), v_out)
    return (k.at[:, dst].set(k_new), v.at[:, dst].set(v_new)), (k_out, v_out)


@jax.jit
def gather_blocks(kv: KVCache, ids: jax.Array) -> KVCache:
    """(k, v) of blocks ``ids``, each [num_layers, P, block_size, kv_heads, head_dim]; the
    cache is not donated (a disaggregated prefill offers the pages and keeps its cache)."""
    k, v = kv
    return k[:, ids], v[:, ids]


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


class BlockMover:
    """Runs ``move_blocks`` for swaps and copies, padded to ``move_sizes(chunk)``.

    Holds one zero input of each size it used (what a swap-out or a copy passes as
    ``k_in`` / ``v_in``: put on the device once, no program runs to make it)."""

    def __init__(self, host: "HostKVPool", programs=None, num_blocks: int | None = None) -> None:
        """``num_blocks``: the device cache's blocks (null block included), which bound a
        call's size (``move_chunk``); None: only the host pool's chunk does."""
        self.host = host
        self.programs = programs
        self.chunk = host.chunk if num_blocks is None else min(
            host.chunk, 1 << max(0, (num_blocks - 1).bit_length()))
        self.sizes = move_sizes(self.chunk)
        self._zeros: dict[int, jax.Array] = {}
        # While programs are still being built (``runtime.program_fallback``): whether the
        # move of a size is built; a move then runs in the smallest built size that holds it.
        self.built: "Callable[[int], bool] | None" = None

    def size_for(self, count: int) -> int:
        """The padded size a move of ``count`` entries (at most the chunk) runs at."""
        fits = [s for s in self.sizes if s >= max(count, 1)]
        if self.built is not None:
            built = [s for s in fits if self.built(s)]
            if built:
                return built[0]
        return fits[0]

    def spec(self, kv: KVCache, size: int) -> tuple:
        """(name, bucket, jitted, args) of the move of ``size`` (``ExecutableCache``'s
        arguments); ``kv`` may be shapes only."""
        layers, block = self.host.k.shape[1], self.host.k.shape[2:]
        blocks = jax.ShapeDtypeStruct((layers, size, *block), self.host.k.dtype)
        index = jax.ShapeDtypeStruct((size,), np.int32)
        return ("move_blocks", (size,), move_blocks,
                (kv, index, index, blocks, blocks, jax.ShapeDtypeStruct((), np.bool_)))

    def _no_input(self, size: int) -> jax.Array:
        zeros = self._zeros.get(size)
        if zeros is None:
            shape = (self.host.k.shape[1], size, *self.host.k.shape[2:])
            zeros = self._zeros[size] = jax.device_put(np.zeros(shape, self.host.k.dtype))
        return zeros

    def call(self, kv: KVCache, src: list[int], dst: list[int],
             blocks: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[KVCache, KVCache]:
        """One ``move_blocks`` call (at most ``chunk`` entries): ``blocks`` (each
        [num_layers, n, ...], host arrays) are written to ``dst`` when given, else the
        blocks read from ``src``. ``src`` / ``dst`` may be empty (nothing read / written)."""
        size = self.size_for(max(len(src), len(dst)))
        if blocks is None:
            k_in = v_in = self._no_input(size)
        else:
            shape = (blocks[0].shape[0], size, *blocks[0].shape[2:])
            k_in, v_in = (np.zeros(shape, self.host.k.dtype) for _ in range(2))
            k_in[:, :blocks[0].shape[1]] = blocks[0]
            v_in[:, :blocks[1].shape[1]] = blocks[1]
        # With nothing to write (a swap-out), every write is padding: zeros into the null
        # block, which then holds only zeros, as before any move.
        args = (kv, jax.device_put(padded(src, [size])), jax.device_put(padded(dst, [size])),
                k_in, v_in, np.bool_(blocks is not None or not dst))
        return run_program(self.programs, move_blocks, *args)

    def swap_out(self, kv: KVCache, pairs: list[tuple[int, int]]) -> KVCache:
        """Copy device blocks to host slots: pairs of (device block, host block)."""
        host = self.host
        for part in _chunks(pairs, self.chunk):
            device_ids, host_ids = zip(*part)
            kv, (k_blocks, v_blocks) = self.call(kv, list(device_ids), [])
            k_blocks, v_blocks = jax.device_get((k_blocks, v_blocks))
            n = len(part)
            host.k[list(host_ids)] = np.moveaxis(k_blocks, 1, 0)[:n]
            host.v[list(host_ids)] = np.moveaxis(v_blocks, 1, 0)[:n]
        return kv

    def swap_in(self, kv: KVCache, pairs: list[tuple[int, int]]) -> KVCache:
        """Copy host slots back into device blocks: pairs of (host block, device block)."""
        host = self.host
        for part in _chunks(pairs, self.chunk):
            host_ids, device_ids = zip(*part)
            blocks = (np.moveaxis(host.k[list(host_ids)], 0, 1),
                      np.moveaxis(host.v[list(host_ids)], 0, 1))
            kv, _ = self.call(kv, [], list(device_ids), blocks)
        return kv

    def copy(self, kv: KVCache, pairs: list[tuple[int, int]]) -> KVCache:
        """Copy-on-write copies: pairs of (src block, dst block). A chunk's reads happen
        before its writes; no copy reads a block another copy of the same step writes
        (the KV manager copies shared blocks into fresh ones)."""
        for part in _chunks(pairs, self.chunk):
            src, dst = zip(*part)
            kv, _ = self.call(kv, list(src), list(dst))
        return kv

    def compile_all(self, kv: KVCache, sizes: list[int] | None = None) -> tuple[KVCache, int]:
        """Run a no-op move of each size (every entry the null block), so each is built;
        (the cache, the number of sizes)."""
        sizes = self.sizes if sizes is None else sizes
        for size in sizes:
            kv, _ = self.call(kv, [0] * size, [])
        return kv, len(sizes)
