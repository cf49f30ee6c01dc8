"""The draft model's programs (speculative decoding, ``runtime.draft_model``): ``fill``
and ``propose`` compiled for a TPU and a GPU without the hardware, with abstract
parameters and KV cache of a small Llama (the same layer code a real draft runs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxpage.arch_config import ArchConfig
from jaxpage.models.llama import CausalLM
from jaxpage.parallel.targets import single_device_spec, target_devices
from jaxpage.runtime.draft_model import _fill_program, _propose_program
from tests.default_suite import SLOW

K = 4
ARCH = dict(architecture="LlamaForCausalLM", vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
            max_position_embeddings=1024)


def _arch() -> ArchConfig:
    return ArchConfig(**ARCH)


@pytest.mark.parametrize("target", ["v5e:1x1", "h100"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float32, marks=SLOW)],
                         ids=["bf16", "f32"])  # float32: with the slow cases
def test_draft_fill_and_propose_compile_for_tpu_and_gpu(target, dtype):
    device = target_devices(target)[0]
    arch = _arch()
    with jax.default_device(device):
        graphdef, state = nnx.split(CausalLM(arch, dtype=dtype, rngs=None))
        params = jax.tree.map(lambda x: single_device_spec(device, x.shape, x.dtype),
                              nnx.to_pure_dict(state))
        blocks, block_size, tokens, seqs, width = 64, 16, 64, 8, 8
        cache = single_device_spec(device, (arch.num_layers, blocks, block_size,
                                            arch.num_kv_heads, arch.head_dim), dtype)

        def spec(shape, kind=jnp.int32):
            return single_device_spec(device, shape, kind)

        fill = jax.jit(_fill_program(graphdef), donate_argnums=(1,))
        fill.lower(params, (cache, cache), spec((3, tokens)), spec((1, width)), spec((1,)),
                   spec((2,)), spec((1,))).compile()
        propose = jax.jit(_propose_program(graphdef, K), donate_argnums=(1,),
                          static_argnums=(6,))
        compiled = propose.lower(params, (cache, cache), spec((5, seqs)),
                                 spec((seqs,), jnp.float32), spec((seqs, width)), spec((1,)),
                                 seqs * K).compile()
        assert compiled is not None
