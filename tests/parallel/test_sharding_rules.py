"""Sharding rules, GQA KV-head repetition and bad sizes: host-only, one device."""

import dataclasses

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpage.arch_config import ArchConfig
from jaxpage.parallel.sharding_rules import (kv_heads_for, param_spec, repeat_kv_heads,
                                             replicated_arch)
from jaxpage.runtime.kv_cache import bytes_per_block, num_blocks_for_budget

ARCH = ArchConfig(architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=64,
                  intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8,
                  rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=128)


@pytest.mark.parametrize("tp,kv", [(1, 2), (2, 2), (4, 4), (8, 8)])
def test_kv_heads_are_repeated_up_to_the_device_count(tp, kv):
    assert kv_heads_for(ARCH, tp) == kv
    assert replicated_arch(ARCH, tp).num_kv_heads == kv


@pytest.mark.parametrize("arch,tp,message", [
    (ARCH, 3, "tensor_parallel_size=3 must divide the model's num_heads=8"),
    (dataclasses.replace(ARCH, num_heads=12, num_kv_heads=3), 4,
     "tensor_parallel_size=4 and num_kv_heads=3"),
])
def test_sizes_that_do_not_fit_raise(arch, tp, message):
    with pytest.raises(ValueError, match=message):
        kv_heads_for(arch, tp)


def test_repeated_heads_pair_each_query_head_with_its_own_kv_head():
    """After repetition, query head h reads a copy of the KV head it read before."""
    L, H, kv, d, r = 2, 16, 2, 4, 4
    weight = np.random.default_rng(0).normal(size=(L, H, kv * d))
    repeated = repeat_kv_heads(weight, kv, d, r).reshape(L, H, kv * r, d)
    heads = weight.reshape(L, H, kv, d)
    num_q = 8
    for h in range(num_q):
        before = h // (num_q // kv)           # original GQA grouping
        after = h // (num_q // (kv * r))      # grouping with kv * r heads
        np.testing.assert_array_equal(repeated[:, :, after], heads[:, :, before])


def test_param_specs():
    assert param_spec("q_proj", (64, 64), 8) == P(None, "tp")      # one layer, [in, out]
    assert param_spec("k_bias", (64,), 8) == P("tp")
    assert param_spec("down_proj", (128, 64), 8) == P("tp", None)
    assert param_spec("embed", (1000, 64), 8) == P("tp", None)
    assert param_spec("embed", (1001, 64), 8) == P()  # an odd vocabulary stays whole
    assert param_spec("input_norm", (64,), 8) == P()
    with pytest.raises(ValueError, match="gate_proj dimension 1 of size 100"):
        param_spec("gate_proj", (64, 100), 8)
    with pytest.raises(ValueError, match="no tensor-parallel sharding rule"):
        param_spec("mystery", (4,), 2)


def test_kv_sizing_is_per_device():
    arch = replicated_arch(ARCH, 8)  # 8 KV heads, one per device
    one = bytes_per_block(arch, 16, np.float32)
    assert bytes_per_block(arch, 16, np.float32, num_shards=8) * 8 == one
    budget = 64 * one
    assert num_blocks_for_budget(arch, 16, np.float32, budget, 10**6) == 63
    assert num_blocks_for_budget(arch, 16, np.float32, budget, 10**6, num_shards=8) == 8 * 64 - 1


def test_more_devices_than_visible_is_a_value_error(tiny_checkpoints):
    from jaxpage import LLM

    with pytest.raises(ValueError, match="needs 16 devices; only"):
        LLM(tiny_checkpoints["llama"], tensor_parallel_size=8, data_parallel_size=2)
