"""Tensor parallelism on 8 virtual CPU devices: identical greedy tokens, 1/N of each weight.

Each check runs in a subprocess (``worker.py``) that starts JAX with 8 CPU devices.
"""

import pytest

from tests.parallel.helpers import ENGINE, run_worker
from tests.reference import hf_greedy, load_hf_model

MAX_TOKENS = 10
# the split axis of each sharded weight (layer weights are one array per layer)
SHARDED = {"embed": 0, "lm_head": 1, "q_proj": 1, "k_proj": 1, "v_proj": 1, "q_bias": 0,
           "k_bias": 0, "v_bias": 0, "gate_proj": 1, "up_proj": 1, "o_proj": 0, "down_proj": 0}


def check_shards(report: dict, tp: int) -> None:
    """Every sharded weight: each device holds exactly 1/tp of it; the rest are replicated."""
    assert report, "no shard report"
    for path, info in report.items():
        name = path.rsplit("/", 1)[-1]
        shards = info["shards"]
        assert len(shards) == tp, (path, shards)
        assert len({device for device, _ in shards}) == tp
        if path == "kv_cache":
            axis = 3
        elif name in SHARDED:
            axis = SHARDED[name]
        else:
            for _, shape in shards:  # norms, o_bias: whole on every device
                assert shape == info["shape"], path
            continue
        for _, shape in shards:
            expected = list(info["shape"])
            expected[axis] //= tp
            assert shape == expected, (path, shape, info["shape"])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tp_1_2_4_8_token_identical(kind, tp_checkpoints, tp_prompts):
    path = tp_checkpoints[kind]
    result = run_worker("tensor_parallel", dict(
        model=path, tp_sizes=[1, 2, 4, 8], prompts=tp_prompts, max_tokens=MAX_TOKENS,
        engine=ENGINE))
    reference = result["1"]["tokens"]
    hf = load_hf_model(path)
    eos = hf.config.eos_token_id
    for prompt, tokens in zip(tp_prompts, reference):
        assert tokens[0] == hf_greedy(hf, prompt, MAX_TOKENS, eos), prompt
    for tp in ("2", "4", "8"):
        assert result[tp]["tokens"] == reference, f"tensor_parallel_size={tp} differs"
        check_shards(result[tp]["shards"], int(tp))
    # GQA: Llama's 2 KV heads are repeated to one per device at 4 and 8 devices
    kv_heads = {tp: result[tp]["num_kv_heads"] for tp in result}
    if kind == "llama":
        assert kv_heads == {"1": 2, "2": 2, "4": 4, "8": 8}
    else:
        assert kv_heads == {"1": 4, "2": 4, "4": 4, "8": 8}


def test_tp_2_llama_quick(tp_checkpoints, tp_prompts):
    """The fast-suite version: 2 devices against 1, shards checked."""
    result = run_worker("tensor_parallel", dict(
        model=tp_checkpoints["llama"], tp_sizes=[1, 2], prompts=tp_prompts[:3], max_tokens=6,
        engine=ENGINE))
    assert result["2"]["tokens"] == result["1"]["tokens"]
    check_shards(result["2"]["shards"], 2)
