"""ArchConfig: the architecture facts a model needs, read from HF config or GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ArchConfig:
    architecture: str            # Hugging Face architecture name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: int | None = None
    rope_scaling: tuple[tuple[str, object], ...] | None = None  # sorted (key, value) pairs

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")

    def rope_inv_freq(self) -> np.ndarray:
        """float32 [head_dim // 2] inverse frequencies, with Llama-3 / linear scaling applied."""
        exponents = np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** exponents)
        scaling = dict(self.rope_scaling or ())
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            pass
        elif kind == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        elif kind == "llama3":
            inv_freq = _llama3_scaled(inv_freq, scaling)
        else:
            raise ValueError(f"rope_scaling type {kind!r} is not supported "
                             "(supported: default, linear, llama3)")
        return inv_freq.astype(np.float32)


def _llama3_scaled(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def freeze_rope_scaling(value: dict | None) -> tuple[tuple[str, object], ...] | None:
    if not value:
        return None
    return tuple(sorted((k, v) for k, v in value.items() if not isinstance(v, (list, dict))))
