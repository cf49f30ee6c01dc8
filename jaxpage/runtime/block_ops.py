"""Whole-block KV operations on the device: copy-on-write copies and host swapping.

One program, ``move_blocks``, does all three: it reads blocks ``src`` (returned, for a
swap-out) and writes blocks ``dst`` with either what it read (a copy) or blocks from the
host (a swap-in). One program kind instead of three keeps the engine's program set small
(``jaxpage.core.batch.program_set``: the set compiled before an engine is ready holds one block
program, of the largest size, which every move can run padded).

Index lists are padded to a rung of ``move_sizes`` (1, 4, 16, ... up to the swap chunk);
padding entries point at the null block 0 (reads of block 0, writes into block 0), which
is never read unmasked. Longer lists run as several calls of at most the chunk.

The cache is a tuple of arrays in either layout (``pallas_kernels.kv_layout``: split
``(k, v)`` or fused ``(kv,)``), each with the blocks on axis 1: every operation here
maps over the tuple and never looks inside a block.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.core.batch.program_set import ProgramKey
from pallas_kernels import _backend
from pallas_kernels.kv_layout import KVCache  # arrays [L, N, B, ...], blocks on axis 1


# The most K+V bytes one block-move call moves: larger moves run as several calls. A
# gather or scatter's temporaries grow with its block count (on TPUs, several times the
# blocks' bytes: the blocks are re-tiled), so an unbounded bucket (every block of the
# cache at once) would not fit next to the cache it copies.
SWAP_CHUNK_BYTES = 128 * 2**20
# Growth of the block-move sizes: 1, 4, 16, ... (each size is a compiled program).
MOVE_SIZE_GROWTH = 4


def swap_chunk(block_bytes: int) -> int:
    """Blocks per swap call: the largest power of two whose bytes (``block_bytes`` per
    block, K and V together) fit in ``SWAP_CHUNK_BYTES``, at least 1."""
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
def move_blocks(kv: KVCache, src: jax.Array, dst: jax.Array, blocks_in: KVCache,
                from_input: jax.Array) -> tuple[KVCache, KVCache]:
    """Read blocks ``src`` (int32 [P]) of every layer, then write blocks ``dst`` (int32
    [P]) with ``blocks_in`` (one [num_layers, P, block_size, ...] per cache array) when
    ``from_input`` (bool []), else with the blocks just read (a copy ``src[i] ->
    dst[i]``). Returns (the cache, the blocks read, before any write). No conditional:
    the choice is an elementwise select, so no platform waits on it."""
    read = tuple(read_blocks(cache, src) for cache in kv)
    written = tuple(jnp.where(from_input, new.astype(cache.dtype), old)
                    for cache, new, old in zip(kv, blocks_in, read))
    return tuple(cache.at[:, dst].set(new) for cache, new in zip(kv, written)), read


@jax.jit
def gather_blocks(kv: KVCache, ids: jax.Array) -> KVCache:
    """Blocks ``ids`` of each cache array, [num_layers, P, block_size, ...]; the cache is
    not donated (a disaggregated prefill offers the pages and keeps its cache)."""
    return tuple(read_blocks(cache, ids) for cache in kv)


def read_blocks(cache: jax.Array, ids: jax.Array, one_by_one: bool | None = None) -> jax.Array:
    """Blocks ``ids`` (int32 [P]) of one cache array [L, N, B, ...] -> [L, P, B, ...].

    A gather everywhere but on TPUs, where XLA implements the gather of wide blocks (a
    fused row of 2,048 lanes: Llama-3-8B's 8 KV heads of 128) by first splitting the
    whole cache into two lane halves, a copy of the cache in every block move (``jaxpage
    plan``: 2.2 GB of temporaries for a 2.2 GB cache). There the blocks are read one by
    one with dynamic slices, whose temporaries are the blocks read, whatever the cache.
    ``one_by_one``: force either form (None: by the platform).
    """
    if one_by_one is None:
        one_by_one = _backend.current_platform() == "tpu"
    if not one_by_one:
        return cache[:, ids]
    out = jnp.zeros((cache.shape[0], ids.shape[0], *cache.shape[2:]), cache.dtype)

    def read_one(i, out):
        block = jax.lax.dynamic_slice_in_dim(cache, ids[i], 1, axis=1)
        return jax.lax.dynamic_update_slice_in_dim(out, block, i, axis=1)

    return jax.lax.fori_loop(0, ids.shape[0], read_one, out)


def run_program(programs, function, *args):
    """``function(*args)``, through the executable cache when one is given (its key: the
    function's name as the kind, the padded index count, the only shape that varies, as
    the bucket)."""
    if programs is None:
        return function(*args)
    key = ProgramKey(function.__name__, tuple(args[1].shape))
    return programs.get(key, function, args)(*args)


class HostKVPool:
    """Host-memory copies of swapped-out blocks: one array [num_host_blocks, layers, ...]
    per cache array (``arrays``, in the cache's order)."""

    def __init__(self, num_blocks: int, block_shapes: list[tuple[int, ...]], dtype) -> None:
        """``block_shapes``: each cache array's block, [layers, block_size, ...]."""
        # np.empty only reserves address space; pages are committed when a swap writes them.
        self.arrays = tuple(np.empty((num_blocks, *shape), dtype) for shape in block_shapes)
        block_bytes = sum(int(np.prod(shape)) for shape in block_shapes) * np.dtype(dtype).itemsize
        self.chunk = swap_chunk(block_bytes)  # blocks per swap program call

    @property
    def num_blocks(self) -> int:
        return self.arrays[0].shape[0]

    @property
    def dtype(self) -> np.dtype:
        return self.arrays[0].dtype


def _chunks(pairs: list[tuple[int, int]], size: int):
    for start in range(0, len(pairs), size):
        yield pairs[start:start + size]


def measure_host_bandwidth(num_bytes: int = 32 * 2**20) -> float:
    """Bytes/s of a copy from the default device to the host (best of three): what a
    swap-out costs a block, for the preemption cost model."""
    data = jnp.ones(num_bytes // 4, jnp.float32).block_until_ready()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        np.array(jax.device_get(data), copy=True)  # on the CPU device_get may alias
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


class BlockMover:
    """Runs ``move_blocks`` for swaps and copies, padded to ``move_sizes(chunk)``.

    Holds one zero input of each size it used (what a swap-out or a copy passes as
    ``blocks_in``: put on the device once, no program runs to make it)."""

    def __init__(self, host: "HostKVPool", programs=None, num_blocks: int | None = None) -> None:
        """``num_blocks``: the device cache's blocks (null block included), which bound a
        call's size (``move_chunk``); None: only the host pool's chunk does."""
        self.host = host
        self.programs = programs
        self.chunk = host.chunk if num_blocks is None else min(
            host.chunk, 1 << max(0, (num_blocks - 1).bit_length()))
        self.sizes = move_sizes(self.chunk)
        self._zeros: dict[int, KVCache] = {}
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

    def _block_shapes(self, size: int) -> list[tuple[int, ...]]:
        """Each cache array's ``size`` blocks: [num_layers, size, block_size, ...]."""
        return [(host.shape[1], size, *host.shape[2:]) for host in self.host.arrays]

    def spec(self, kv: KVCache, size: int) -> tuple:
        """(key, jitted, args) of the move of ``size`` (``ExecutableCache``'s arguments);
        ``kv`` may be shapes only."""
        blocks = tuple(jax.ShapeDtypeStruct(shape, self.host.dtype)
                       for shape in self._block_shapes(size))
        index = jax.ShapeDtypeStruct((size,), np.int32)
        return (ProgramKey("move_blocks", (size,)), move_blocks,
                (kv, index, index, blocks, jax.ShapeDtypeStruct((), np.bool_)))

    def _no_input(self, size: int) -> KVCache:
        zeros = self._zeros.get(size)
        if zeros is None:
            zeros = self._zeros[size] = tuple(
                jax.device_put(np.zeros(shape, self.host.dtype))
                for shape in self._block_shapes(size))
        return zeros

    def call(self, kv: KVCache, src: list[int], dst: list[int],
             blocks: tuple[np.ndarray, ...] | None = None) -> tuple[KVCache, KVCache]:
        """One ``move_blocks`` call (at most ``chunk`` entries): ``blocks`` (one per cache
        array, each [num_layers, n, ...], host arrays) are written to ``dst`` when given,
        else the blocks read from ``src``. ``src`` / ``dst`` may be empty (nothing read /
        written)."""
        size = self.size_for(max(len(src), len(dst)))
        if blocks is None:
            blocks_in = self._no_input(size)
        else:
            blocks_in = tuple(np.zeros(shape, self.host.dtype)
                              for shape in self._block_shapes(size))
            for padded_blocks, given in zip(blocks_in, blocks):
                padded_blocks[:, :given.shape[1]] = given
        # With nothing to write (a swap-out), every write is padding: zeros into the null
        # block, which then holds only zeros, as before any move.
        args = (kv, jax.device_put(padded(src, [size])), jax.device_put(padded(dst, [size])),
                blocks_in, np.bool_(blocks is not None or not dst))
        return run_program(self.programs, move_blocks, *args)

    def swap_out(self, kv: KVCache, pairs: list[tuple[int, int]]) -> KVCache:
        """Copy device blocks to host slots: pairs of (device block, host block)."""
        for part in _chunks(pairs, self.chunk):
            device_ids, host_ids = zip(*part)
            kv, read = self.call(kv, list(device_ids), [])
            for host, blocks in zip(self.host.arrays, jax.device_get(read)):
                host[list(host_ids)] = np.moveaxis(blocks, 1, 0)[:len(part)]
        return kv

    def swap_in(self, kv: KVCache, pairs: list[tuple[int, int]]) -> KVCache:
        """Copy host slots back into device blocks: pairs of (host block, device block)."""
        for part in _chunks(pairs, self.chunk):
            host_ids, device_ids = zip(*part)
            blocks = tuple(np.moveaxis(host[list(host_ids)], 0, 1) for host in self.host.arrays)
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
