"""Every dense family the registry names equals Hugging Face on tiny random checkpoints.

Each checkpoint is made locally with ``transformers`` in the shape that exercises what
its family adds: Qwen3's q/k norms (6 query heads on 3 KV heads, head_dim unrelated to
the hidden size), Phi-3's fused projections and partial RoPE, Gemma 2's soft caps that
bite and alternating sliding layers, Gemma 3's local/global layers with their own RoPE
bases (the global one scaled). Windows are shorter than the prompts, so they cut.
Prefill logits match within 1e-4 relative (float32, chunked prefill); greedy outputs of
16 prompts in one batch, with chunked prefill and preemption, equal ``generate``.
"""

import pytest

from tests.default_suite import SLOW
from tests.engine.test_greedy_matches_hf import check_against_hf
from tests.models.test_logits_match_hf import check_logits
from tests.reference import make_tiny_checkpoint

WINDOW = 8
FAMILY_SHAPES = {
    "qwen3": dict(num_attention_heads=6, num_key_value_heads=3, head_dim=16),
    "phi3": dict(partial_rotary_factor=0.5, pad_token_id=0),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                   attn_logit_softcapping=1.5, final_logit_softcapping=4.0,
                   num_hidden_layers=4),
    "gemma3": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                   sliding_window=WINDOW, num_hidden_layers=4,
                   layer_types=["sliding_attention", "full_attention",
                                "sliding_attention", "sliding_attention"],
                   rope_parameters={
                       "full_attention": {"rope_type": "linear", "factor": 2.0,
                                          "rope_theta": 1_000_000.0},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
    # more experts than the top-k; Qwen2-MoE with a shared expert and one dense layer
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, mlp_only_layers=[1]),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                      head_dim=16, norm_topk_prob=True),
}


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory, smollm2_tokenizer) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {kind: make_tiny_checkpoint(kind, str(root / kind), smollm2_tokenizer, seed=10 + i,
                                       **shape)
            for i, (kind, shape) in enumerate(FAMILY_SHAPES.items())}


@pytest.mark.parametrize("kind", sorted(FAMILY_SHAPES))
def test_family_prefill_logits_match_hf(kind, family_checkpoints, smollm2_tokenizer):
    check_logits(family_checkpoints[kind], smollm2_tokenizer)


# The engine's greedy run adds nothing family-specific that the prefill logits above do
# not check, but the sliding windows' blocks given back and the experts' routing under
# preemption: the default suite runs Gemma 3 (local and global layers; a mixture of experts
# runs against Hugging Face in tests/engine/test_lora.py's Mixtral); every family with the
# slow cases.
GREEDY_IN_DEFAULT_SUITE = ("gemma3",)


@pytest.mark.parametrize("kind", [
    pytest.param(kind, marks=[] if kind in GREEDY_IN_DEFAULT_SUITE else SLOW)
    for kind in sorted(FAMILY_SHAPES)])
def test_family_greedy_matches_hf_under_chunking_and_preemption(kind, family_checkpoints,
                                                                smollm2_tokenizer):
    check_against_hf(family_checkpoints[kind], smollm2_tokenizer, max_tokens=24,
                     num_kv_blocks=24)
