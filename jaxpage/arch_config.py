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
    # -- beyond Llama (the defaults are Llama's) --------------------------------------
    # per layer, True where the layer attends only within ``sliding_window`` (Gemma 2/3,
    # Qwen2/3 with max_window_layers); None: every layer does when ``sliding_window`` is set
    sliding_layers: tuple[bool, ...] | None = None
    qk_norm: bool = False            # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0         # RMSNorm scales by (offset + weight) in float32 (Gemma: 1)
    sandwich_norms: bool = False     # norms on the attention and MLP outputs too (Gemma 2/3)
    hidden_act: str = "silu"         # the gated MLP's activation: "silu" or "gelu_tanh"
    embed_scale: float | None = None  # embeddings multiplied by it (Gemma: sqrt(hidden_size))
    attn_scale: float | None = None  # softmax scale of q.k (None: head_dim ** -0.5)
    attn_softcap: float | None = None   # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    rotary_dim: int | None = None    # RoPE on the first rotary_dim channels only (None: all)
    local_rope_theta: float | None = None  # RoPE base of sliding layers, unscaled (Gemma 3)
    fused_projections: bool = False  # the checkpoint stores qkv_proj / gate_up_proj (Phi-3)
    # -- mixture of experts (num_experts 0: every MLP dense) ---------------------------
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0   # each expert's hidden width
    shared_expert_intermediate_size: int = 0  # an always-on expert, sigmoid-gated (Qwen2-MoE)
    norm_topk_prob: bool = True      # renormalize the top-k routing weights to sum 1
    # per layer, True where the MLP is the experts; None: every layer (when num_experts)
    sparse_layers: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise ValueError(f"sliding_layers has {len(self.sliding_layers)} entries for "
                             f"{self.num_layers} layers")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported "
                             "(supported: silu, gelu_tanh)")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"[1, num_experts={self.num_experts}]")
        if self.sparse_layers is not None and len(self.sparse_layers) != self.num_layers:
            raise ValueError(f"sparse_layers has {len(self.sparse_layers)} entries for "
                             f"{self.num_layers} layers")
        rotary = self.rotary_dim
        if rotary is not None and (rotary % 2 or not 0 < rotary <= self.head_dim):
            raise ValueError(f"rotary_dim={rotary} must be even and in (0, {self.head_dim}]")
        self.rope_inv_freq()  # an unsupported RoPE scaling fails here, at load

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is the mixture of experts."""
        if not self.num_experts:
            return False
        return self.sparse_layers is None or self.sparse_layers[layer]

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: it attends to the whole context)."""
        if self.sliding_layers is not None and not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    @property
    def all_layers_local(self) -> bool:
        """Every layer attends within ``sliding_window``: older KV is never read again."""
        return self.sliding_window is not None and (
            self.sliding_layers is None or all(self.sliding_layers))

    def rope_inv_freq(self, local: bool = False) -> np.ndarray:
        """float32 [rotary_dim // 2] inverse frequencies, with Llama-3 / linear scaling
        applied; ``local``: those of the sliding layers (``local_rope_theta``, unscaled)."""
        dim = self.rotary_dim or self.head_dim
        exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
        if local and self.local_rope_theta is not None:
            return (1.0 / (self.local_rope_theta ** exponents)).astype(np.float32)
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
