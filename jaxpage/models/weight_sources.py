"""Picks the weight source for a model path: orbax checkpoint, HF directory or GGUF file.

Every source has ``hf_config`` (a Hugging Face style config dict), ``saved_dtype`` (the
dtype ``dtype="auto"`` means for it, or None), ``run_arch(arch, tp_size)`` (the
architecture as it will run on ``tp_size`` devices) and ``read_params(arch, run_arch,
template, placement, dtype)`` (the model's pure param dict, every array already on its
devices). The loader works through that interface alone; a new format is a new source
class added to ``SOURCES``, tried in order. A source whose class sets
``caches_conversion`` (GGUF) also takes ``cache_dir`` for what it converts.
"""

from __future__ import annotations

import os
from typing import Any

from jaxpage.models.gguf_source import GGUFSource
from jaxpage.models.orbax_source import OrbaxSource
from jaxpage.models.safetensors_source import SafetensorsSource

SOURCES = (OrbaxSource, SafetensorsSource, GGUFSource)


def open_source(path: str, cache_dir: str | None = None) -> Any:
    """The source that reads ``path``; a ``ValueError`` names the path if none does.

    ``cache_dir``: where sources that convert (GGUF) keep what they converted, or None.
    """
    for source in SOURCES:
        if source.accepts(path):
            if getattr(source, "caches_conversion", False):
                return source(path, cache_dir=cache_dir)
            return source(path)
    if os.path.isfile(path):
        raise ValueError(f"model={path!r} is a file but not a .gguf file; pass a GGUF file "
                         "or a Hugging Face checkpoint directory")
    raise ValueError(f"model={path!r} does not exist (expected a Hugging Face checkpoint "
                     "directory, a .gguf file or a jaxpage orbax checkpoint; nothing is "
                     "downloaded)")
