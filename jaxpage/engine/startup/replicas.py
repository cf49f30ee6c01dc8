"""Builds the engine a ``ParallelConfig`` asks for: one replica, M replicas, or one of N processes.

An engine concern built from ``jaxpage.parallel``'s parts (meshes, the router, the
process mirror); ``LLM`` and the server call ``build_engine``.

* ``tensor_parallel_size=N``: one ``LLMEngine`` on a mesh of N devices.
* ``data_parallel_size=M``: M engines on disjoint groups of N devices behind a
  ``DataParallelEngine`` router.
* ``num_processes > 1``: ``jax.distributed`` is started first; process 0 gets the engine
  with its runner mirrored to the others; every other process serves those calls in
  ``build_engine`` and then exits (``SystemExit(0)``) when process 0 stops. Swapping to
  host memory is off there (``swap_space=0``): preempted requests are recomputed.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from jaxpage.config import EngineConfig
from jaxpage.engine.llm_engine import LLMEngine
from jaxpage.parallel import distributed
from jaxpage.parallel.placement import replica_meshes
from jaxpage.parallel.router import DataParallelEngine

logger = logging.getLogger("jaxpage")


def build_engine(config: EngineConfig) -> Any:
    """An ``LLMEngine`` or a ``DataParallelEngine`` for ``config`` (see the module docstring)."""
    parallel = config.parallel
    if parallel.num_processes > 1 and config.cache.swap_space:
        # each process would have to keep its own heads' host copies; until then, preempted
        # requests are recomputed
        logger.warning("swap_space=%s ignored with num_processes=%d: preemption recomputes",
                       config.cache.swap_space, parallel.num_processes)
        config = dataclasses.replace(config, cache=dataclasses.replace(config.cache,
                                                                       swap_space=0.0))
    distributed.initialize(parallel)
    if parallel.data_parallel_size == 1:
        engine = LLMEngine(config)
    else:
        meshes = replica_meshes(parallel.tensor_parallel_size, parallel.data_parallel_size)
        engine = DataParallelEngine([LLMEngine(config, mesh=mesh) for mesh in meshes])
    if parallel.num_processes > 1:
        if distributed.is_leader():
            distributed.mirror_engine_runners(engine)
        else:
            distributed.follow(engine.runner)
            raise SystemExit(0)
    return engine
