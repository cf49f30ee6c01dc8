"""Tokenizer loading through transformers, offline.

A GGUF file's tokenizer is converted by transformers once (seconds) and the result is
saved under the jaxpage cache directory, keyed by the file's path, size and mtime.
"""

from __future__ import annotations

import hashlib
import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def cache_dir() -> str:
    root = os.environ.get("JAXPAGE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "jaxpage")
    return root


def _gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    stat = os.stat(path)
    key = hashlib.sha1(f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    cached = os.path.join(cache_dir(), "tokenizers", key[:16])
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(cached)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".",
                                              gguf_file=os.path.basename(path))
    tmp = f"{cached}.tmp{os.getpid()}"
    tokenizer.save_pretrained(tmp)
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    try:
        os.replace(tmp, cached)
    except OSError:  # another process won the race; its copy is as good as ours
        pass
    return tokenizer


def load_tokenizer(model_path: str, tokenizer: str | None = None) -> PreTrainedTokenizerBase | None:
    """The tokenizer for a model, or None when the checkpoint ships none (token ids only)."""
    path = os.path.expanduser(tokenizer) if tokenizer is not None else model_path
    if os.path.isfile(path) and path.endswith(".gguf"):
        return _gguf_tokenizer(path)
    if os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return AutoTokenizer.from_pretrained(path)
    if tokenizer is not None:
        raise ValueError(f"tokenizer={tokenizer!r} is neither a tokenizer directory nor a .gguf file")
    return None
