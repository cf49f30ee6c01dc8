"""Maps Hugging Face architecture names to our model class and config adapter."""

from __future__ import annotations

from typing import Any, Callable

from jaxpage.arch_config import ArchConfig, freeze_rope_scaling
from jaxpage.models.llama import CausalLM


def _common(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    num_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    rope_theta = hf.get("rope_theta")
    rope_parameters = hf.get("rope_parameters") or {}
    if rope_theta is None:
        rope_theta = rope_parameters.get("rope_theta", 10000.0)
    rope_scaling = hf.get("rope_scaling") or {
        k: v for k, v in rope_parameters.items() if k != "rope_theta"} or None
    return dict(
        architecture=architecture, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=num_heads, num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=head_dim, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_scaling=freeze_rope_scaling(rope_scaling))


def llama_config(hf: dict[str, Any]) -> ArchConfig:
    if hf.get("mlp_bias"):
        raise ValueError("Llama checkpoints with mlp_bias=True are not supported")
    bias = bool(hf.get("attention_bias", False))
    return ArchConfig(**_common(hf, "LlamaForCausalLM"), qkv_bias=bias, o_bias=bias)


def mistral_config(hf: dict[str, Any]) -> ArchConfig:
    return ArchConfig(**_common(hf, "MistralForCausalLM"), sliding_window=hf.get("sliding_window"))


def qwen2_config(hf: dict[str, Any]) -> ArchConfig:
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if window is not None and hf.get("max_window_layers", 0) < hf["num_hidden_layers"]:
        raise ValueError("Qwen2 with sliding window on only some layers is not supported")
    return ArchConfig(**_common(hf, "Qwen2ForCausalLM"), qkv_bias=True, sliding_window=window)


# architecture name -> (model class, HF config.json dict -> ArchConfig)
MODEL_REGISTRY: dict[str, tuple[type, Callable[[dict[str, Any]], ArchConfig]]] = {
    "LlamaForCausalLM": (CausalLM, llama_config),
    "MistralForCausalLM": (CausalLM, mistral_config),
    "Qwen2ForCausalLM": (CausalLM, qwen2_config),
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def resolve_architecture(hf_config: dict[str, Any]) -> tuple[type, ArchConfig]:
    names = hf_config.get("architectures") or []
    for name in names:
        if name in MODEL_REGISTRY:
            model_cls, adapter = MODEL_REGISTRY[name]
            return model_cls, adapter(hf_config)
    raise ValueError(f"model architecture {names!r} is not supported; "
                     f"supported architectures: {supported_architectures()}")
