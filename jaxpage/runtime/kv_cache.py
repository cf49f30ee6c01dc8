"""The paged KV cache on device and its sizing.

The cache is a tuple of arrays in one of ``pallas_kernels.kv_layout``'s layouts: split
``(k, v)`` on CPUs and GPUs, fused ``(kv,)`` on TPUs (``kv_layout.for_platform``). Every
array has the layers on axis 0, the blocks on axis 1 and the KV heads on axis 3, so
block moves and the tensor-parallel split never depend on the layout.

Under tensor parallelism the cache is split by KV head over the ``tp`` devices, so each
device holds ``1 / num_shards`` of every block: sizes here are per device when
``num_shards`` is given, since every device's memory must hold its share.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpage.arch_config import ArchConfig
from pallas_kernels import kv_layout


def bytes_per_block(arch: ArchConfig, block_size: int, dtype, num_shards: int = 1,
                    layout: str = kv_layout.SPLIT, token_scales: bool = False) -> int:
    """K and V bytes of one block across all layers, on each of ``num_shards`` devices,
    padding included (a fused row pads head dims other than 64 and multiples of 128),
    with ``token_scales`` a byte more per token, head and K or V (``kv_token_scale``).

    ``arch.num_kv_heads`` is the count the model runs with (after GQA repetition), a
    multiple of ``num_shards``.
    """
    itemsize = np.dtype(dtype).itemsize
    heads = arch.num_kv_heads // num_shards
    if layout == kv_layout.FUSED:
        return arch.num_layers * block_size * kv_layout.row_width(heads, arch.head_dim) * itemsize
    scales = 2 * arch.num_layers * block_size * heads if token_scales else 0
    return 2 * arch.num_layers * block_size * heads * arch.head_dim * itemsize + scales


def num_blocks_for_budget(arch: ArchConfig, block_size: int, dtype, budget_bytes: int,
                          max_useful_blocks: int, num_shards: int = 1,
                          layout: str = kv_layout.SPLIT, token_scales: bool = False) -> int:
    """Usable blocks (null block excluded) that fit ``budget_bytes`` per device, capped."""
    per_block = bytes_per_block(arch, block_size, dtype, num_shards, layout, token_scales)
    fitting = budget_bytes // per_block - 1  # one block of the budget goes to the null block
    if fitting < 1:
        raise ValueError(f"kv_cache_memory={budget_bytes} bytes holds no KV block "
                         f"({per_block} bytes each)")
    return int(min(fitting, max_useful_blocks))


def cache_shapes(arch: ArchConfig, num_blocks: int, block_size: int,
                 layout: str, token_scales: bool = False) -> tuple[tuple[int, ...], ...]:
    """The global shape of each cache array (``num_blocks`` with the null block). Split
    over devices on axis 3, each device holds whole heads: a fused row is its heads'
    slots side by side, so one device's shard of it is the fused row of its own heads."""
    return kv_layout.cache_shapes(layout, arch.num_layers, num_blocks, block_size,
                                  arch.num_kv_heads, arch.head_dim, token_scales)


def allocate_kv_cache(arch: ArchConfig, num_blocks: int, block_size: int, dtype,
                      sharding: jax.sharding.Sharding | None = None,
                      layout: str = kv_layout.SPLIT,
                      token_scales: bool = False) -> tuple[jax.Array, ...]:
    """The zeroed cache: split (k, v), each [num_layers, num_blocks, block_size,
    num_kv_heads, head_dim] (then ``token_scales``' codes [num_layers, num_blocks,
    block_size, num_kv_heads] for keys and values), or fused (kv,) [num_layers,
    num_blocks, block_size, W].

    ``num_blocks`` includes the null block 0. With a ``sharding`` (KV heads over the
    mesh, axis 3) each device allocates only its own heads.
    """
    shapes = cache_shapes(arch, num_blocks, block_size, layout, token_scales)
    if sharding is None:
        return tuple(jnp.zeros(shape, dtype) for shape in shapes)
    zeros = jax.jit(lambda: tuple(jnp.zeros(shape, dtype) for shape in shapes),
                    out_shardings=tuple(sharding for _ in shapes))
    return zeros()


def blocks_from_device_memory(bytes_limit: int, peak_bytes: int, utilization: float,
                              per_block: int, max_useful_blocks: int) -> int:
    """Usable blocks that fit ``utilization * bytes_limit`` after the profiled peak.

    ``peak_bytes``: device memory in use at the peak of a step at the largest bucket
    (weights, activations, a minimal cache). Raises if nothing is left for the cache.
    """
    free = int(utilization * bytes_limit) - peak_bytes
    blocks = free // per_block - 1  # one block goes to the null block
    if blocks < 1:
        raise ValueError(f"no device memory left for the KV cache: {peak_bytes} bytes in use "
                         f"at peak, memory_utilization={utilization} of {bytes_limit}")
    return int(min(blocks, max_useful_blocks))


def device_memory_stats() -> dict | None:
    """The first device's memory statistics, or None where the platform has none (CPU)."""
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # some backends raise instead of returning None
        return None
    return stats if stats and "bytes_limit" in stats else None
