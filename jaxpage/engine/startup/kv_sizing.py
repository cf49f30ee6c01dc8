"""How many KV blocks an engine gets: given, profiled from device memory, or a byte budget.

* ``num_kv_blocks`` in the config wins;
* on a device that reports memory (GPU, TPU): run the largest step bucket with a 2-block
  cache, read the peak, and give the cache ``memory_utilization`` of the device minus
  that peak. The probe runs the step with a structured-outputs mask (int32 [S,
  ceil(V / 32)], the biggest per-step input, unpacked to [S, V] inside), so the peak
  includes the mask's buffers: with a large vocabulary the cache leaves room for them;
* else (the CPU): ``kv_cache_memory`` bytes.

Never more blocks than ``max_num_seqs`` sequences of ``max_model_len`` tokens can use.
``droppable_window``: how far back a sequence keeps its blocks when every layer slides.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxpage.config import EngineConfig
from jaxpage.core.batch.builder import BatchBuilder
from jaxpage.core.kv.block_pool import BlockPool
from jaxpage.core.kv.kv_cache_manager import KVCacheManager
from jaxpage.runtime.kv_cache import (blocks_from_device_memory, bytes_per_block,
                                      device_memory_stats, num_blocks_for_budget)
from jaxpage.runtime.model_runner import ModelRunner
from pallas_kernels import kv_layout, kv_token_scale


def choose_num_kv_blocks(config: EngineConfig, loaded: Any, max_model_len: int, dtype: Any,
                         num_shards: int, extra_bytes_per_block: int = 0,
                         layout: str = kv_layout.SPLIT) -> int:
    """The cache size in blocks (the null block not counted); KV sizes are per device.

    ``extra_bytes_per_block``: another cache with the same blocks shares the budget (a
    draft model's, ``jaxpage.runtime.draft_model``)."""
    cache, sched = config.cache, config.scheduler
    blocks_per_seq = -(-max_model_len // cache.block_size)
    max_useful = sched.max_num_seqs * blocks_per_seq
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if device_memory_stats() is not None:
        return _profile(config, loaded, max_model_len, dtype, max_useful, num_shards,
                        extra_bytes_per_block, layout)
    if extra_bytes_per_block:
        per_block = bytes_per_block(loaded.arch, cache.block_size, dtype, num_shards, layout,
                                    _token_scales(loaded, layout))
        budget = cache.kv_cache_memory * per_block // (per_block + extra_bytes_per_block)
    else:
        budget = cache.kv_cache_memory
    return num_blocks_for_budget(loaded.arch, cache.block_size, dtype, budget,
                                 max_useful_blocks=max_useful, num_shards=num_shards,
                                 layout=layout, token_scales=_token_scales(loaded, layout))


def _token_scales(loaded: Any, layout: str) -> bool:
    """Whether ``loaded``'s cache in ``layout`` keeps per-token scales (``kv_token_scale``)."""
    return kv_token_scale.applies(getattr(loaded, "kv_format", None), layout)


def _profile(config: EngineConfig, loaded: Any, max_model_len: int, dtype: Any,
             max_useful: int, num_shards: int, extra_bytes_per_block: int = 0,
             layout: str = kv_layout.SPLIT) -> int:
    """Run the largest bucket with a 2-block cache, read peak memory, size the cache."""
    sched, block_size = config.scheduler, config.cache.block_size
    probe = ModelRunner(loaded, num_blocks=2, block_size=block_size,
                        max_num_seqs=sched.max_num_seqs, layout=layout)
    builder = BatchBuilder(KVCacheManager(BlockPool(2), block_size),
                           max_num_batched_tokens=sched.max_num_batched_tokens,
                           max_num_seqs=sched.max_num_seqs, max_model_len=max_model_len,
                           bucket_growth=sched.bucket_growth)
    batch = builder.empty(*max(builder.step_shapes()))
    mask = np.full((batch.block_tables.shape[0], probe.mask_words), -1, np.int32)
    probe.execute(batch, token_mask=mask)
    stats = device_memory_stats()
    del probe
    return blocks_from_device_memory(
        stats["bytes_limit"], stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0)),
        config.cache.memory_utilization,
        bytes_per_block(loaded.arch, block_size, dtype, num_shards, layout,
                        _token_scales(loaded, layout)) + extra_bytes_per_block,
        max_useful)


def droppable_window(arch, draft_arch=None) -> int | None:
    """The window behind which a sequence's KV blocks are given back: set when every
    layer of the model (and of a draft model sharing its block tables) slides."""
    archs = [arch] + ([draft_arch] if draft_arch is not None else [])
    if not all(a.all_layers_local for a in archs):
        return None
    return max(a.sliding_window for a in archs)
