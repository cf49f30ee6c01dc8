"""Hugging Face checkpoint directories: config.json plus safetensors (single or sharded)."""

from __future__ import annotations

import functools
import json
import os
import struct

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from jaxpage.models.hf_layout import HFTensorSource
from jaxpage.models.prequantized import stored_quantization


class SafetensorsSource(HFTensorSource):
    """Reads tensors by their Hugging Face names from a checkpoint directory."""

    @staticmethod
    def accepts(path: str) -> bool:
        return os.path.isdir(path)

    def __init__(self, directory: str) -> None:
        config_path = os.path.join(directory, "config.json")
        if not os.path.isfile(config_path):
            raise ValueError(f"model directory {directory!r} has no config.json")
        with open(config_path) as f:
            self.hf_config: dict = json.load(f)
        self.directory = directory
        self._handles: dict[str, object] = {}
        # a pre-quantized checkpoint's method (compressed-tensors, AWQ, GPTQ), else None
        self.stored = stored_quantization(self.hf_config, directory)

    @functools.cached_property
    def _file_of(self) -> dict[str, str]:
        """Tensor name -> file; read on first use, so config errors surface first."""
        directory = self.directory
        index_path = os.path.join(directory, "model.safetensors.index.json")
        single_path = os.path.join(directory, "model.safetensors")
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            return {name: os.path.join(directory, file) for name, file in weight_map.items()}
        if os.path.isfile(single_path):
            with safe_open(single_path, "numpy") as f:
                return {name: single_path for name in f.keys()}
        raise ValueError(f"model directory {directory!r} has neither model.safetensors "
                         "nor model.safetensors.index.json")

    def names(self) -> set[str]:
        return set(self._file_of)

    def get(self, name: str) -> np.ndarray:
        """The tensor as stored, Hugging Face layout ([out, in] for linear weights)."""
        if name not in self._file_of:
            raise ValueError(f"checkpoint has no tensor named {name!r}")
        path = self._file_of[name]
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(path, "numpy")
        try:
            return handle.get_tensor(name)
        except (AttributeError, TypeError):  # a dtype numpy lacks (FP8): read its bytes
            return raw_tensor(path, name)


# safetensors dtypes that its numpy reader cannot build, as ml_dtypes' numpy types
_RAW_DTYPES = {"F8_E4M3": jnp.float8_e4m3fn, "F8_E5M2": jnp.float8_e5m2,
               "F8_E8M0": jnp.float8_e8m0fnu,  # power-of-two scales (FP8 "ue8m0")
               "BF16": jnp.bfloat16}


def raw_tensor(path: str, name: str) -> np.ndarray:
    """Tensor ``name`` of the safetensors file ``path`` read from its bytes (the format:
    an 8-byte little-endian header length, a JSON header of dtype / shape / data_offsets,
    then the data)."""
    with open(path, "rb") as f:
        length = struct.unpack("<Q", f.read(8))[0]
        info = json.loads(f.read(length))[name]
        if info["dtype"] not in _RAW_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {info['dtype']}, which jaxpage cannot read")
        start, end = info["data_offsets"]
        f.seek(8 + length + start)
        data = f.read(end - start)
    return np.frombuffer(data, _RAW_DTYPES[info["dtype"]]).reshape(info["shape"])
