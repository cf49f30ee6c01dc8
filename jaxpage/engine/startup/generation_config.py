"""A checkpoint's ``generation_config.json`` sampling defaults (vLLM's ``--generation-config``).

``"auto"`` (vLLM's default): the sampling fields the checkpoint's generation config sets
(``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, and
``max_new_tokens`` as ``max_tokens``) become the defaults of requests that do not set
them; ``"vllm"``: none (the OpenAI and ``SamplingParams`` defaults); a directory: read its
``generation_config.json`` instead of the checkpoint's.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger("jaxpage")

# generation_config.json key -> SamplingParams field
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model_path: str | None, mode: str = "auto") -> dict[str, Any]:
    """The sampling defaults ``mode`` gives for the checkpoint at ``model_path`` (a
    directory, a file, or None for the embedded default, which has none)."""
    if mode == "vllm":
        return {}
    if mode == "auto":
        if model_path is None or not os.path.isdir(model_path):
            return {}
        directory = model_path
    else:
        directory = mode
        if not os.path.isdir(directory):
            raise ValueError(f"generation_config={mode!r} must be 'auto', 'vllm' or a "
                             f"directory holding generation_config.json")
    path = os.path.join(directory, "generation_config.json")
    if not os.path.exists(path):
        return {}
    try:
        config = json.loads(open(path, encoding="utf-8").read())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read {path}: {error}") from None
    defaults = {field: config[key] for key, field in _FIELDS.items()
                if isinstance(config.get(key), (int, float)) and not isinstance(config.get(key), bool)}
    if defaults:
        logger.info("sampling defaults from %s: %s", path, defaults)
    return defaults
