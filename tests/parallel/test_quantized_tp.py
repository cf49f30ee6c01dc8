"""Quantized weights and a byte KV cache under tensor parallelism (8 virtual CPU devices).

Each part of a quantized weight is split as its weight is (``sharding_rules.param_spec``):
codes with the weight, per-group scales with it where the groups divide, the byte cache
and its scales by KV head. Greedy tokens are the same at every size.
"""

import pytest

from tests.parallel.helpers import ENGINE, run_worker


@pytest.mark.slow
def test_int8_weights_and_int8_kv_tp_1_2_4(tp_checkpoints, tp_prompts):
    engine = {**ENGINE, "quantization": "int8", "kv_cache_dtype": "int8"}
    result = run_worker("tensor_parallel", dict(
        model=tp_checkpoints["llama"], tp_sizes=[1, 2, 4], prompts=tp_prompts[:4],
        max_tokens=8, engine=engine))
    for tp in ("2", "4"):
        assert result[tp]["tokens"] == result["1"]["tokens"], f"tensor_parallel_size={tp}"
        report = result[tp]["shards"]
        shards = report["layers/0/q_proj/codes"]["shards"]       # [in, out]: split by out
        assert all(s[1] == report["layers/0/q_proj/codes"]["shape"][1] // int(tp)
                   for _, s in shards)
        down = report["layers/0/down_proj/codes"]                # [in, out]: split by in
        assert all(s[0] == down["shape"][0] // int(tp) for _, s in down["shards"])
        kv = report["kv_cache"]
        assert all(s[3] == kv["shape"][3] // int(tp) for _, s in kv["shards"])
        assert report["kv_scale"]["shards"][0][1][2] == report["kv_scale"]["shape"][2] // int(tp)


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["gptq_actorder", "ct_fp8_static", "hf_fp8_block32",
                                     "ct_fp8_block"])   # activations rounded per group
def test_prequantized_checkpoint_tp_1_2(fixture, tmp_path):
    """A pre-quantized checkpoint's stored parts shard like their weights (an act-order
    permutation and a static activation scale are replicated; FP8 block scales split with
    their weight): the same greedy tokens at tensor_parallel_size 1 and 2."""
    import os

    from tests.models.test_prequantized import hf_fp8_checkpoint

    if fixture == "hf_fp8_block32":
        model = hf_fp8_checkpoint(tmp_path / fixture, block=[32, 32])
    else:
        model = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "quantized",
                             fixture)
    prompts = [[1, 5, 9, 17, 33, 65], [200, 7, 3, 99, 150, 42, 250]]
    result = run_worker("tensor_parallel", dict(
        model=model, tp_sizes=[1, 2], prompts=prompts, max_tokens=8,
        engine={**ENGINE, "max_model_len": 64}))
    assert result["2"]["tokens"] == result["1"]["tokens"]
    report = result["2"]["shards"]
    codes = report["layers/0/q_proj/codes"]                      # [in, out]: split by out
    assert all(s[1] == codes["shape"][1] // 2 for _, s in codes["shards"])
    for part in ("perm", "input_scale"):
        if f"layers/0/q_proj/{part}" in report:
            entry = report[f"layers/0/q_proj/{part}"]
            assert all(s == entry["shape"] for _, s in entry["shards"])  # whole on each


@pytest.mark.slow
def test_fused_int8_kv_tp_1_2(tmp_path, smollm2_tokenizer, tp_prompts, monkeypatch):
    """The TPU's fused layout (``JAXPAGE_KV_LAYOUT``), int8: each device holds whole head
    slots of the one cache array, their scale codes inside their value bytes
    (``kv_token_scale.embedded``), so splitting the heads changes no token."""
    from tests.reference import make_tiny_checkpoint

    monkeypatch.setenv("JAXPAGE_KV_LAYOUT", "fused")   # the workers inherit it
    model = make_tiny_checkpoint("llama", str(tmp_path / "llama"), smollm2_tokenizer, seed=13,
                                 hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                                 num_hidden_layers=2)   # head_dim 16: the codes' 16 bytes
    result = run_worker("tensor_parallel", dict(
        model=model, tp_sizes=[1, 2], prompts=tp_prompts[:4], max_tokens=8,
        engine={**ENGINE, "kv_cache_dtype": "int8"}))
    assert result["2"]["tokens"] == result["1"]["tokens"]
    kv = result["2"]["shards"]["kv_cache"]
    assert len(kv["shape"]) == 4                                   # [L, N, B, W]: fused
    assert all(s[3] == kv["shape"][3] // 2 for _, s in kv["shards"])
