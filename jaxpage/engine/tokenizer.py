"""Tokenizer loading through transformers, offline, without PyTorch.

A GGUF file stores its tokenizer as metadata. We read those fields with the ``gguf``
package and hand them to transformers' own GGUF tokenizer converter (whose file reader,
unlike the converter, imports torch). The result is saved under the jaxpage cache
directory, keyed by the file's path, size and mtime, so later loads are instant.

transformers is imported when a tokenizer is loaded, not with this module, and a saved
GGUF tokenizer is read back through ``PreTrainedTokenizerFast`` (the class it was saved
from): ``AutoTokenizer`` imports PyTorch, about 1.7 s of a warm start on the CPU.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING

from jaxpage.config import cache_dir

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    stat = os.stat(path)
    key = hashlib.sha1(f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    cached = os.path.join(cache_dir(), "tokenizers", key[:16])
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(cached)
    tokenizer = convert_gguf_file_tokenizer(path)
    tmp = f"{cached}.tmp{os.getpid()}"
    tokenizer.save_pretrained(tmp)
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    try:
        os.replace(tmp, cached)
    except OSError:  # another process won the race; its copy is as good as ours
        pass
    return tokenizer


def _field_value(reader: GGUFReader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def convert_gguf_file_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """Build the fast tokenizer a GGUF file describes (same result as transformers' loader)."""
    from gguf import GGUFReader
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer)

    reader = GGUFReader(path)
    groups = {group: {} for group in GGUF_TOKENIZER_MAPPING}
    for group, renames in GGUF_TOKENIZER_MAPPING.items():
        for key, name in renames.items():
            value = _field_value(reader, f"tokenizer.{key}")
            if value is not None:
                groups[group][name] = value
    tokenizer_dict, config = groups["tokenizer"], groups["tokenizer_config"]
    if "tokens" not in tokenizer_dict:
        raise ValueError(f"GGUF file {path!r} carries no tokenizer; pass tokenizer=...")
    if tokenizer_dict.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)
    tokens = tokenizer_dict["tokens"]
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unk_token_id"), ("pad_token", "pad_token_id")):
        token_id = tokenizer_dict.get(key)
        if token_id is not None:
            config[name] = tokens[int(token_id)]
    backend, _ = convert_gguf_tokenizer(_field_value(reader, "general.architecture"),
                                        tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config)


def load_tokenizer(model_path: str, tokenizer: str | None = None) -> PreTrainedTokenizerBase | None:
    """The tokenizer for a model, or None when the checkpoint ships none (token ids only)."""
    if tokenizer is None and model_path.startswith("preset:"):
        return None  # random-weight presets take token ids
    path = os.path.expanduser(tokenizer) if tokenizer is not None else model_path
    if os.path.isfile(path) and path.endswith(".gguf"):
        return _gguf_tokenizer(path)
    if os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    if tokenizer is not None:
        raise ValueError(f"tokenizer={tokenizer!r} is neither a tokenizer directory nor a .gguf file")
    return None
