"""The single step with a structured-outputs grammar mask (``step-masked``: an int32
[S, ceil(V / 32)] mask unpacked and applied in the sampler) compiled for a TPU and a GPU
without the hardware, over abstract parameters and KV cache of a small Llama with a
vocabulary that is not a multiple of 32 (the mask's last word is partial)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxpage.arch_config import ArchConfig
from jaxpage.core.batch.builder import BatchBuilder
from jaxpage.core.kv.block_pool import BlockPool
from jaxpage.core.kv.kv_cache_manager import KVCacheManager
from jaxpage.models.llama import CausalLM
from jaxpage.parallel.targets import single_device_spec, target_devices
from jaxpage.runtime.step import make_step
from tests.default_suite import SLOW

ARCH = dict(architecture="LlamaForCausalLM", vocab_size=4100, hidden_size=256,
            intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
            rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=1024)


@pytest.mark.parametrize("target", ["v5e:1x1", "h100"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float32, marks=SLOW)],
                         ids=["bf16", "f32"])  # float32: with the slow cases
def test_masked_step_compiles_for_tpu_and_gpu(target, dtype):
    device = target_devices(target)[0]
    arch = ArchConfig(**ARCH)
    blocks, block_size, seqs = 64, 16, 8
    builder = BatchBuilder(KVCacheManager(BlockPool(blocks), block_size),
                           max_num_batched_tokens=32, max_num_seqs=seqs, max_model_len=256)
    packed = builder.empty(*max(builder.step_shapes())).packed()
    rows = builder.empty(*max(builder.step_shapes())).block_tables.shape[0]
    with jax.default_device(device):
        graphdef, state = nnx.split(CausalLM(arch, dtype=dtype, rngs=None))
        params = jax.tree.map(lambda x: single_device_spec(device, x.shape, x.dtype),
                              nnx.to_pure_dict(state))
        cache = single_device_spec(device, (arch.num_layers, blocks, block_size,
                                            arch.num_kv_heads, arch.head_dim), dtype)
        penalties = single_device_spec(device, (seqs, arch.vocab_size), jnp.int32)
        batch = tuple(single_device_spec(device, a.shape, a.dtype) for a in packed)
        step = make_step(graphdef)
        compiled = step.lower(params, ((cache, cache), penalties), batch,
                              single_device_spec(device, (seqs,), jnp.int32),
                              single_device_spec(device, (rows, -(-arch.vocab_size // 32)),
                                                 jnp.int32)).compile()
        assert compiled is not None
