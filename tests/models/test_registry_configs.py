"""Config adapters: real-checkpoint config styles map to the right ArchConfig, and what
is not supported is refused at load with the offending value."""

import pytest

from jaxpage.models.registry import resolve_architecture

BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2)


def _arch(name, **fields):
    return resolve_architecture(dict(BASE, architectures=[name], **fields))[1]


def test_gemma3_config_in_the_checkpoint_style_before_transformers_5():
    arch = _arch("Gemma3ForCausalLM", head_dim=16, sliding_window=512, rope_theta=1e6,
                 rope_local_base_freq=10000.0, query_pre_attn_scalar=256,
                 rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=6)
    assert arch.sliding_layers == (True,) * 5 + (False,)
    assert arch.window(0) == 512 and arch.window(5) is None
    assert arch.rope_theta == 1e6 and arch.local_rope_theta == 10000.0
    assert dict(arch.rope_scaling)["factor"] == 8.0
    assert arch.attn_scale == 256 ** -0.5 and arch.embed_scale == 8.0
    assert arch.norm_offset == 1.0 and arch.qk_norm and arch.tie_word_embeddings


def test_qwen2_slides_only_from_max_window_layers():
    arch = _arch("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=32,
                 max_window_layers=4)
    assert arch.sliding_layers == (False,) * 4 + (True,) * 2
    assert not arch.all_layers_local
    every = _arch("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=32,
                  max_window_layers=0)
    assert every.sliding_layers is None and every.all_layers_local


def test_qwen_moe_dense_layers_and_experts():
    arch = _arch("Qwen2MoeForCausalLM", num_experts=60, num_experts_per_tok=4,
                 moe_intermediate_size=32, shared_expert_intermediate_size=96,
                 mlp_only_layers=[0], decoder_sparse_step=2)
    assert [arch.is_sparse(i) for i in range(6)] == [False, True, False, True, False, True]
    assert not arch.norm_topk_prob and arch.shared_expert_intermediate_size == 96


@pytest.mark.parametrize("name, fields, message", [
    ("Phi3ForCausalLM", dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 8,
                                           "long_factor": [1.0] * 8}), "'longrope'"),
    ("Gemma2ForCausalLM", dict(head_dim=16, hidden_activation="relu"), "'relu'"),
    ("Gemma2ForCausalLM", dict(head_dim=16, layer_types=["chunked_attention"] * 6),
     "chunked_attention"),
    ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=5), "5"),
])
def test_unsupported_configs_are_refused_with_the_value(name, fields, message):
    with pytest.raises(ValueError, match=message):
        _arch(name, **fields)
