"""Save an engine's converted params as an orbax checkpoint (``LLM(model=path)`` restores).

The format (and the reading side) is ``jaxpage.models.orbax_source``; this module only
gathers what an engine knows: replica 0's runner, its architecture as run, the tokenizer.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

from jaxpage.models import orbax_source
from jaxpage.models.quantize import plan_to_json


def save_checkpoint(engine: Any, path: str) -> str:
    """Save ``engine``'s params (an LLMEngine, or replica 0 of a router) to a new ``path``."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path) and os.listdir(path):
        raise ValueError(f"path={path!r} exists and is not empty; pass a new directory")
    replica = getattr(engine, "engines", [engine])[0]
    runner = replica.runner
    metadata = {"format": orbax_source.FORMAT, "hf_config": runner.hf_config,
                "arch": dataclasses.asdict(runner.arch), "dtype": str(runner.dtype),
                "tensor_parallel_size": runner.placement.tp_size,
                "quantization": getattr(runner, "quantization", None),
                "quant_plan": plan_to_json(getattr(runner, "quant_plan", None) or {})}
    os.makedirs(path, exist_ok=True)
    if hasattr(runner, "mirror_call"):  # several processes: every one writes its shards
        runner.mirror_call(f"{orbax_source.__name__}:save_state", path, metadata)
    else:
        orbax_source.save_state(runner, path, metadata)
    if replica.tokenizer is not None and jax.process_index() == 0:
        replica.tokenizer.save_pretrained(path)
    return path
