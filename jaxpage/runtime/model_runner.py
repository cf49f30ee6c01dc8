"""ModelRunner: owns the params, the KV cache and the compiled step on the device."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jaxpage.core.batch import BatchMetadata
from jaxpage.models.loader import LoadedModel
from jaxpage.runtime.kv_cache import allocate_kv_cache
from jaxpage.runtime.step import make_forward_logits, make_step


class ModelRunner:
    """Executes BatchMetadata on the device. ``num_blocks`` includes the null block."""

    def __init__(self, loaded: LoadedModel, *, num_blocks: int, block_size: int) -> None:
        self.arch = loaded.arch
        graphdef, self.state = nnx.split(loaded.model)
        dtype = loaded.model.embed[...].dtype
        self.kv_cache = allocate_kv_cache(self.arch, num_blocks, block_size, dtype)
        self._step = make_step(graphdef)
        self._forward_logits = make_forward_logits(graphdef)
        self.compiled_shapes: set[tuple[int, int, int]] = set()

    def execute(self, batch: BatchMetadata) -> np.ndarray:
        """Run one step; returns sampled token ids int32 [S] (rows past num_seqs are junk)."""
        self.compiled_shapes.add(batch.shape_key)
        self.kv_cache, tokens = self._step(self.state, self.kv_cache, jax.device_put(batch.as_dict()))
        return np.asarray(tokens)

    def logits(self, batch: BatchMetadata) -> np.ndarray:
        """Run one step and return float32 logits [T, V] for every token (the cache is updated)."""
        self.kv_cache, logits = self._forward_logits(self.state, self.kv_cache,
                                                     jax.device_put(batch.as_dict()))
        return np.asarray(logits)
