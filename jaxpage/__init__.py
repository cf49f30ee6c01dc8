"""jaxpage: a JAX/XLA-native LLM inference engine with vLLM's offline API.

Public names are imported lazily, so ``import jaxpage.core`` (the host-side scheduler
and block manager) never pulls in JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "jaxpage.engine.llm",
    "LLMEngine": "jaxpage.engine.llm_engine",
    "SamplingParams": "jaxpage.sampling_params",
    "StructuredOutputsParams": "jaxpage.sampling_params",
    "RequestOutput": "jaxpage.outputs",
    "CompletionOutput": "jaxpage.outputs",
    "Logprob": "jaxpage.outputs",
    "AsyncLLMEngine": "jaxpage.engine.async_llm_engine",
    "EngineConfig": "jaxpage.config",
    "ModelConfig": "jaxpage.config",
    "CacheConfig": "jaxpage.config",
    "SchedulerConfig": "jaxpage.config",
    "BeamSearchParams": "jaxpage.beam_search",
    "BeamSearchOutput": "jaxpage.beam_search",
    "BeamSearchSequence": "jaxpage.beam_search",
    "LoRARequest": "jaxpage.lora_request",
    "plan": "jaxpage.planning",
    "PlanReport": "jaxpage.planning",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxpage' has no attribute {name!r}")
