"""Named model shapes with random weights made on the device (nothing is downloaded).

``LLM(model="preset:llama3-8b")`` builds a model of that shape, for benchmarks on machines
without network or checkpoints. Presets have no tokenizer: prompts are token ids.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(architectures=["LlamaForCausalLM"], vocab_size=4096, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0,
                       rms_norm_eps=1e-5),
    "llama3-1b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048,
                      intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama3-8b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, rms_norm_eps=1e-5),
    "qwen2-7b": dict(architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=3584,
                     intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, max_position_embeddings=32768,
                     rope_theta=1000000.0, rms_norm_eps=1e-6),
}
PREFIX = "preset:"


def preset_config(name: str) -> dict[str, Any]:
    """The HF-style config dict of a preset given as ``preset:<name>``."""
    key = name[len(PREFIX):]
    if key not in PRESETS:
        raise ValueError(f"model={name!r}: unknown preset; available: "
                         f"{[PREFIX + k for k in sorted(PRESETS)]}")
    return dict(PRESETS[key])
