"""Mixture of experts under tensor parallelism (8 virtual CPU devices): the experts are
split over the mesh axis (expert parallelism), each device holding num_experts / N of
them, and greedy tokens are identical at 1, 2 and 4 devices."""

import pytest

from tests.parallel.helpers import ENGINE, run_worker
from tests.reference import make_tiny_checkpoint


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory, smollm2_tokenizer) -> str:
    # Qwen2-MoE: 8 experts, top 2, a sigmoid-gated shared expert, the second layer dense
    return make_tiny_checkpoint(
        "qwen2_moe", str(tmp_path_factory.mktemp("moe_tp")), smollm2_tokenizer, seed=31,
        num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=2, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[1])


def test_moe_tp_1_2_4_token_identical_with_experts_split(moe_checkpoint, tp_prompts):
    result = run_worker("tensor_parallel", dict(
        model=moe_checkpoint, tp_sizes=[1, 2, 4], prompts=tp_prompts[:4], max_tokens=8,
        engine=ENGINE))
    for tp in ("2", "4"):
        assert result[tp]["tokens"] == result["1"]["tokens"], f"tensor_parallel_size={tp}"
        report = result[tp]["shards"]
        for name in ("expert_gate", "expert_up", "expert_down"):
            experts = report[f"layers/0/{name}"]               # [E, ...]: split by expert
            assert experts["shape"][0] == 8
            assert all(s[0] == 8 // int(tp) for _, s in experts["shards"]), name
        assert "layers/1/expert_gate" not in report            # the dense layer
        shared = report["layers/0/shared_gate_proj"]            # [in, out]: split by out
        assert all(s[1] == shared["shape"][1] // int(tp) for _, s in shared["shards"])
