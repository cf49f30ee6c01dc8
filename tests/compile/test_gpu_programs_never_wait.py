"""On a GPU the engine's programs hold no branch the host must wait for.

XLA:GPU runs a conditional by reading its predicate back to the host (the launching
thread blocks on the stream), and a while loop of unknown length does so every
iteration (``pallas_kernels._backend.branches_wait_for_device``). With the sampling
features decided on the host (``jaxpage.core.batch.step_features``), the single step, the
verify step and the multi-step decode loop compiled for an H100 without the hardware
have no conditional, and their only loops have a known trip count; so do the programs
that decide on the device (``features=None``: on a GPU they do all the optional work,
``runtime.step.branch_free``), and so does every program of an engine's set.
"""

from __future__ import annotations

import re

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
from jaxpage.runtime.decode_loop import make_decode_loop
from jaxpage.runtime.step import make_step
from jaxpage.core.batch.step_features import ALL_FEATURES, NO_FEATURES
from tests.default_suite import SLOW

# Enough layers and tokens that RoPE's table would be computed once behind a conditional
# on the CPU (``CausalLM._rope_tables``).
ARCH = dict(architecture="LlamaForCausalLM", vocab_size=4096, hidden_size=256,
            intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
            rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=1024)
BLOCKS, BLOCK_SIZE, SEQS, STEPS = 64, 16, 8, 4


def _compiled_text(kind: str, features) -> str:
    """The optimized HLO of one program of the small model, compiled for an H100."""
    device = target_devices("h100")[0]
    arch = ArchConfig(**ARCH)
    builder = BatchBuilder(KVCacheManager(BlockPool(BLOCKS), BLOCK_SIZE),
                           max_num_batched_tokens=512, max_num_seqs=SEQS, max_model_len=256)
    shape = max(builder.step_shapes()) if kind != "decode" else max(builder.decode_shapes())
    packed = builder.empty(*shape).packed()
    spec = lambda shape, dtype: single_device_spec(device, shape, dtype)  # noqa: E731
    with jax.default_device(device):
        graphdef, state = nnx.split(CausalLM(arch, dtype=jnp.bfloat16, rngs=None))
        params = jax.tree.map(lambda x: spec(x.shape, x.dtype), nnx.to_pure_dict(state))
        cache = spec((arch.num_layers, BLOCKS, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim),
                     jnp.bfloat16)
        caches = ((cache, cache), spec((SEQS, arch.vocab_size), jnp.int32))
        batch = tuple(spec(a.shape, a.dtype) for a in packed)
        carry = spec((SEQS,), jnp.int32)
        if kind == "step":
            program = make_step(graphdef, features=features).lower(params, caches, batch, carry)
        elif kind == "verify":
            program = make_step(graphdef, verify=True, features=features).lower(
                params, caches, batch, carry, spec((2, arch.vocab_size), jnp.float32),
                spec((shape[0],), jnp.int32))
        else:
            program = make_decode_loop(graphdef, STEPS, BLOCK_SIZE, features=features,
                                       fixed_length=features is not None).lower(
                params, caches, batch, carry, spec((SEQS,), jnp.bool_),
                spec((shape[1],), jnp.int32))
        return program.compile().as_text()


def _host_waits(text: str) -> list[str]:
    """The instructions of ``text`` that make XLA:GPU's host wait, as "kind: instruction":
    every conditional, and every while loop without a known trip count."""
    waits = []
    for line in text.splitlines():
        op = re.match(r"\s*(?:ROOT )?%\S+ = .*? (conditional|while)\(", line)
        if op and (op.group(1) == "conditional" or "known_trip_count" not in line):
            waits.append(f"{op.group(1)}: {line.strip()[:120]}")
    return waits


# The step and verify kinds, and no features, with the slow cases: the engine's whole set
# (below) holds host-decided steps and verify steps too.
@pytest.mark.parametrize("kind", [pytest.param("step", marks=SLOW),
                                  pytest.param("verify", marks=SLOW), "decode"])
@pytest.mark.parametrize("features", [pytest.param(NO_FEATURES, marks=SLOW), ALL_FEATURES],
                         ids=["none", "all"])
def test_host_decided_programs_have_no_branch_the_host_waits_for(kind, features):
    text = _compiled_text(kind, features)
    assert _host_waits(text) == []
    if kind == "decode":  # the K iterations are still a loop, of known length
        assert re.search(r" while\(.*known_trip_count", text)


def test_every_program_the_engine_builds_never_waits_on_a_gpu():
    """Every program of an engine's set on an H100 (``AbstractEngine.programs("all")``,
    what a live engine compiles over its life): the single steps and decode loops of
    every bucket, host- and device-decided (the program a batch with top-k / top-p,
    penalties, log-probabilities, min_tokens or logit biases runs: on a GPU it does all of
    that for every row, ``runtime.step.branch_free``), the speculative verify steps, block
    moves and the penalty fill, with the first layer of the default model."""
    from jaxpage.config import EngineConfig
    from jaxpage.planning.abstract_engine import AbstractEngine

    config = EngineConfig.from_kwargs(
        model=None, dtype="bfloat16", hf_overrides={"num_hidden_layers": 1},
        max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, num_scheduler_steps=4,
        swap_space=0.0005, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    engine = AbstractEngine(config, target_devices("h100"), num_kv_blocks=64)
    programs = list(engine.programs("all"))
    kinds = {p.key.kind for p in programs}
    assert {"step", "decode", "verify", "move_blocks", "penalty_fill"} <= kinds, kinds
    assert any(p.key.device_decided for p in programs)
    waits = {p.label: _host_waits(engine.compile(p).as_text()) for p in programs}
    assert {label: w for label, w in waits.items() if w} == {}
