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


def _layer_types(hf: dict[str, Any]) -> tuple[bool, ...] | None:
    """Per layer, True for a sliding-window layer, from the config's ``layer_types``."""
    types = hf.get("layer_types")
    if not types:
        return None
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer_types {sorted(unknown)} are not supported "
                         "(supported: sliding_attention, full_attention)")
    return tuple(t == "sliding_attention" for t in types)


def _windowed(hf: dict[str, Any], window: int | None,
              sliding: tuple[bool, ...] | None) -> dict[str, Any]:
    """``sliding_window`` / ``sliding_layers`` fields (none when no layer slides)."""
    if window is None or (sliding is not None and not any(sliding)):
        return dict(sliding_window=None)
    return dict(sliding_window=int(window),
                sliding_layers=None if sliding is None or all(sliding) else sliding)


def mistral_config(hf: dict[str, Any]) -> ArchConfig:
    return ArchConfig(**_common(hf, "MistralForCausalLM"),
                      **_windowed(hf, hf.get("sliding_window"), _layer_types(hf)))


def _qwen_windows(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen2/3: layers from ``max_window_layers`` on slide when ``use_sliding_window``."""
    if not hf.get("use_sliding_window"):
        return dict(sliding_window=None)
    sliding = _layer_types(hf) or tuple(
        i >= hf.get("max_window_layers", 0) for i in range(hf["num_hidden_layers"]))
    return _windowed(hf, hf.get("sliding_window"), sliding)


def qwen2_config(hf: dict[str, Any]) -> ArchConfig:
    return ArchConfig(**_common(hf, "Qwen2ForCausalLM"), qkv_bias=True, **_qwen_windows(hf))


def qwen3_config(hf: dict[str, Any]) -> ArchConfig:
    bias = bool(hf.get("attention_bias", False))
    return ArchConfig(**_common(hf, "Qwen3ForCausalLM"), qkv_bias=bias, qk_norm=True,
                      **_qwen_windows(hf))


def phi3_config(hf: dict[str, Any]) -> ArchConfig:
    common = _common(hf, "Phi3ForCausalLM")
    partial = hf.get("partial_rotary_factor") or (
        hf.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0
    rotary = int(common["head_dim"] * partial)
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Phi-3 hidden_act={hf['hidden_act']!r} is not supported (silu)")
    return ArchConfig(**common, fused_projections=True,
                      rotary_dim=None if rotary == common["head_dim"] else rotary,
                      **_windowed(hf, hf.get("sliding_window"), _layer_types(hf)))


def _experts(hf: dict[str, Any], *, normalize: bool | None = None) -> dict[str, Any]:
    """Mixture-of-experts fields: experts, top-k, expert width, the shared expert, and
    which layers are sparse (Qwen: ``mlp_only_layers`` and ``decoder_sparse_step``)."""
    count = hf.get("num_experts") or hf.get("num_local_experts")
    layers = hf["num_hidden_layers"]
    dense = set(hf.get("mlp_only_layers") or ())
    step = hf.get("decoder_sparse_step") or 1
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return dict(num_experts=int(count), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf.get("moe_intermediate_size")
                                          or hf["intermediate_size"]),
                shared_expert_intermediate_size=int(
                    hf.get("shared_expert_intermediate_size") or 0),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)) if normalize is None
                else normalize,
                sparse_layers=None if all(sparse) else sparse)


def mixtral_config(hf: dict[str, Any]) -> ArchConfig:
    return ArchConfig(**_common(hf, "MixtralForCausalLM"), **_experts(hf, normalize=True),
                      **_windowed(hf, hf.get("sliding_window"), _layer_types(hf)))


def qwen2_moe_config(hf: dict[str, Any]) -> ArchConfig:
    return ArchConfig(**_common(hf, "Qwen2MoeForCausalLM"), qkv_bias=True, **_experts(hf),
                      **_qwen_windows(hf))


def qwen3_moe_config(hf: dict[str, Any]) -> ArchConfig:
    bias = bool(hf.get("attention_bias", False))
    return ArchConfig(**_common(hf, "Qwen3MoeForCausalLM"), qkv_bias=bias, qk_norm=True,
                      **_experts(hf), **_qwen_windows(hf))


_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def _gemma(hf: dict[str, Any], architecture: str, *, every: int) -> dict[str, Any]:
    """What Gemma 2 and 3 share: (1 + w) norms, four norms per layer, a GeGLU MLP, the
    embedding scale, the query scale, soft caps, and one full-attention layer in
    ``every`` (the others slide) unless the config lists ``layer_types``."""
    common = _common(hf, architecture)
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        raise ValueError(f"Gemma hidden_activation={act!r} is not supported "
                         f"(supported: {', '.join(_GELU_TANH)})")
    sliding = _layer_types(hf) or tuple(
        bool((i + 1) % every) for i in range(hf["num_hidden_layers"]))
    scalar = hf.get("query_pre_attn_scalar") or common["head_dim"]
    common["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", True))
    return dict(common, norm_offset=1.0, sandwich_norms=True, hidden_act="gelu_tanh",
                embed_scale=float(hf["hidden_size"]) ** 0.5, attn_scale=float(scalar) ** -0.5,
                attn_softcap=hf.get("attn_logit_softcapping"),
                final_softcap=hf.get("final_logit_softcapping"),
                **_windowed(hf, hf.get("sliding_window"), sliding))


def gemma2_config(hf: dict[str, Any]) -> ArchConfig:
    return ArchConfig(**_gemma(hf, "Gemma2ForCausalLM", every=2))


def gemma3_config(hf: dict[str, Any]) -> ArchConfig:
    fields = _gemma(hf, "Gemma3ForCausalLM", every=hf.get("sliding_window_pattern")
                    or hf.get("_sliding_window_pattern") or 6)
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers >= 5: RoPE per layer type
        full, local = params["full_attention"], params.get("sliding_attention") or {}
        fields["rope_theta"] = float(full.get("rope_theta", 1_000_000.0))
        fields["rope_scaling"] = freeze_rope_scaling(
            {k: v for k, v in full.items() if k != "rope_theta"})
        local_theta = local.get("rope_theta", 10_000.0)
        if local.get("rope_type", "default") != "default":
            raise ValueError("Gemma 3 sliding layers with RoPE scaling are not supported")
    else:  # older configs: rope_theta (+ rope_scaling) global, rope_local_base_freq local
        local_theta = hf.get("rope_local_base_freq", 10_000.0)
    return ArchConfig(**fields, qk_norm=True, local_rope_theta=float(local_theta))


# architecture name -> (model class, HF config.json dict -> ArchConfig)
MODEL_REGISTRY: dict[str, tuple[type, Callable[[dict[str, Any]], ArchConfig]]] = {
    "LlamaForCausalLM": (CausalLM, llama_config),
    "MistralForCausalLM": (CausalLM, mistral_config),
    "Qwen2ForCausalLM": (CausalLM, qwen2_config),
    "Qwen3ForCausalLM": (CausalLM, qwen3_config),
    "Phi3ForCausalLM": (CausalLM, phi3_config),
    "Gemma2ForCausalLM": (CausalLM, gemma2_config),
    "Gemma3ForCausalLM": (CausalLM, gemma3_config),
    "MixtralForCausalLM": (CausalLM, mixtral_config),
    "Qwen2MoeForCausalLM": (CausalLM, qwen2_moe_config),
    "Qwen3MoeForCausalLM": (CausalLM, qwen3_moe_config),
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
