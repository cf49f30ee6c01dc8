"""Hugging Face Hub model ids: ``LLM("meta-llama/Llama-3.1-8B-Instruct")`` and ``jaxpage serve
ORG/NAME`` resolve the id to a local snapshot, as vLLM does.

``huggingface_hub.snapshot_download`` fetches (or, offline, finds) only the files the
loaders read: the config, the generation config, the tokenizer and chat template files,
and the safetensors weights with their index; a repository holding no safetensors but
exactly one ``.gguf`` file gets that file. The standard cache is used (``HF_HOME`` /
``HF_HUB_CACHE``; ``download_dir`` overrides it), ``HF_HUB_OFFLINE=1`` resolves from the
cache alone, and ``revision`` picks a branch, tag or commit.

A model argument that is a local path, a ``preset:`` or None (the embedded default) is
returned unchanged. Anything else that is not a valid repository id, or that cannot be
resolved, is a ``ValueError`` naming it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from jaxpage.config import EngineConfig

logger = logging.getLogger("jaxpage")

# What the loaders read (``models.weight_sources``, ``engine.tokenizer``).
MODEL_FILES = ["config.json", "generation_config.json", "*.safetensors",
               "*.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
               "tokenizer.model", "special_tokens_map.json", "vocab.json", "merges.txt",
               "added_tokens.json", "chat_template.jinja", "chat_template.json",
               "preprocessor_config.json"]


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def is_hub_id(model: str) -> bool:
    """``model`` reads as a Hub repository id (``NAME`` or ``ORG/NAME``) and names no local
    file or directory."""
    if os.path.exists(os.path.expanduser(model)):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def resolve_model(model: str | None, *, revision: str | None = None,
                  download_dir: str | None = None) -> str | None:
    """The local path of ``model`` (see the module docstring): unchanged when it is None, a
    ``preset:`` or a local path; else the snapshot directory of that Hub id (a repository
    with only GGUF weights: the path of its one ``.gguf`` file)."""
    if model is None or model.startswith("preset:") or os.path.exists(os.path.expanduser(model)):
        return model
    if model.startswith(("/", ".", "~")) or model.count("/") > 1:
        raise ValueError(f"model path {model!r} does not exist")
    if not is_hub_id(model):
        raise ValueError(f"model={model!r} is neither a local path nor a Hugging Face Hub "
                         f"model id (ORG/NAME)")
    from huggingface_hub import snapshot_download

    offline = _offline()
    try:
        path = snapshot_download(model, revision=revision, cache_dir=download_dir,
                                 allow_patterns=MODEL_FILES, local_files_only=offline)
        if not any(Path(path).glob("*.safetensors")):
            path = _gguf_snapshot(model, path, revision, download_dir, offline)
    except Exception as error:  # noqa: BLE001 - every failure becomes one clear error
        where = ("in the local Hugging Face cache (HF_HUB_OFFLINE is set)" if offline
                 else "on the Hugging Face Hub or in the local cache")
        raise ValueError(f"model={model!r} is not a local path, and the Hub id could not "
                         f"be resolved {where}"
                         + (f" at revision {revision!r}" if revision else "")
                         + f": {type(error).__name__}: {error}") from error
    logger.info("model %s: %s", model, path)
    return path


def _gguf_snapshot(model: str, path: str, revision: str | None, download_dir: str | None,
                   offline: bool) -> str:
    """The one ``.gguf`` file of a repository without safetensors (listed first online, so a
    repository of many quantizations downloads nothing)."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    if offline:
        found = [f.name for f in Path(snapshot_download(
            model, revision=revision, cache_dir=download_dir, allow_patterns=["*.gguf"],
            local_files_only=True)).glob("*.gguf")]
    else:
        found = [f for f in HfApi().list_repo_files(model, revision=revision)
                 if f.endswith(".gguf")]
    if len(found) != 1:
        raise FileNotFoundError(
            f"the repository has no safetensors weights and {len(found)} .gguf files "
            f"({sorted(found)[:8]}); pass the path of one .gguf file instead")
    return hf_hub_download(model, found[0], revision=revision, cache_dir=download_dir,
                           local_files_only=offline)


def resolve_hub_models(config: EngineConfig) -> EngineConfig:
    """``config`` with a Hub id given as the model or the tokenizer replaced by its local
    snapshot (``resolve_model``; local paths, presets and None stay)."""
    mc = config.model
    model = resolve_model(mc.model, revision=mc.revision, download_dir=mc.download_dir)
    tokenizer = resolve_model(mc.tokenizer, revision=mc.revision, download_dir=mc.download_dir)
    if (model, tokenizer) == (mc.model, mc.tokenizer):
        return config
    return dataclasses.replace(config, model=dataclasses.replace(mc, model=model,
                                                                 tokenizer=tokenizer))
