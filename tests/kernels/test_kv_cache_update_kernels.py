"""Pallas KV cache update (GPU and TPU variants, interpret mode) vs the reference scatter.

The cache going in is poisoned (NaN everywhere, or random values): slots that no token
writes must come back bit-identical (the caches are aliased to the outputs), written
slots must hold exactly the new values, and slot -1 is skipped.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels.kv_cache_update import kv_cache_update
from pallas_kernels.kv_cache_update.tpu import kv_cache_update_tpu

from tests.kernels.mode import BACKENDS, INTERPRET, require_backend


def make_update(seed, *, num_blocks=7, block_size=4, num_kv_heads=3, head_dim=64,
                num_tokens=11, skip=0.3, cache_dtype=np.float32, new_dtype=np.float32,
                poison="nan"):
    rng = np.random.default_rng(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if poison == "nan":
        k_cache = np.full(shape, np.nan, np.float32)
        v_cache = np.full(shape, np.nan, np.float32)
    else:
        k_cache = rng.standard_normal(shape).astype(np.float32)
        v_cache = rng.standard_normal(shape).astype(np.float32)
    k_new = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    v_new = rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    slots = rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int32)
    slots[rng.random(num_tokens) < skip] = -1
    return tuple(map(jnp.asarray, (k_cache.astype(cache_dtype), v_cache.astype(cache_dtype),
                                   k_new.astype(new_dtype), v_new.astype(new_dtype), slots)))


def check(args, backend, **kwargs):
    want_k, want_v = kv_cache_update(*args, backend="reference")
    got_k, got_v = kv_cache_update(*args, backend=backend, interpret=INTERPRET, **kwargs)
    slots = np.asarray(args[4])
    for got, want in ((got_k, want_k), (got_v, want_v)):
        assert got.shape == want.shape and got.dtype == want.dtype
        got = np.asarray(got.astype(jnp.float32)).reshape(-1, *got.shape[2:])
        want = np.asarray(want.astype(jnp.float32)).reshape(-1, *want.shape[2:])
        written = slots[slots >= 0]
        assert np.isfinite(got[written]).all(), "a written slot is not finite"
        np.testing.assert_array_equal(got, want)  # NaN where untouched, exact elsewhere


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", [
    dict(),
    dict(num_kv_heads=1, head_dim=128, num_tokens=5),
    dict(num_kv_heads=8, block_size=16, num_blocks=3, num_tokens=40, skip=0.5),
    dict(cache_dtype=jnp.bfloat16, new_dtype=np.float32, poison="random"),
    dict(skip=1.0),
], ids=["gqa3", "one_head_d128", "eight_heads_many_tokens", "bf16_cache_f32_new", "all_skipped"])
def test_kernel_matches_reference(backend, options):
    check(make_update(len(repr(options)), **options), backend)


def test_tpu_token_steps_that_do_not_divide_the_batch():
    require_backend("tpu")
    args = make_update(3, num_tokens=13)
    want = kv_cache_update(*args, backend="reference")
    for step in (1, 4, 13, 64):
        got = kv_cache_update_tpu(*args, interpret=INTERPRET, tokens_per_step=step)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(6))
def test_random_updates(backend, seed):
    rng = np.random.default_rng(100 + seed)
    check(make_update(seed, num_blocks=int(rng.integers(2, 9)),
                      block_size=int(rng.choice([4, 8, 16])),
                      num_kv_heads=int(rng.choice([1, 2, 3, 8])),
                      head_dim=int(rng.choice([64, 128])),
                      num_tokens=int(rng.integers(1, 24)), skip=float(rng.uniform(0, 0.6)),
                      cache_dtype=[np.float32, jnp.bfloat16][seed % 2],
                      poison=["nan", "random"][seed % 3 == 0]), backend)


@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
def test_layer_of_a_whole_cache_is_updated_in_place(backend):
    """With ``layer``, the caches hold every layer [L, N, B, Hkv, D]: only that layer's
    slots change (a slot past the layer's range is skipped, never spilled into the next
    layer), and the result equals updating the layer's own 4-D cache."""
    k4, v4, k_new, v_new, slots = make_update(11, poison="random")
    slots = slots.at[0].set(k4.shape[0] * k4.shape[1])      # out of the layer's range
    k5 = jnp.stack([k4 + 1, k4, k4 - 1])                     # [3, N, B, Hkv, D]
    v5 = jnp.stack([v4 + 1, v4, v4 - 1])
    if backend != "reference":
        require_backend(backend)
    got_k, got_v = kv_cache_update(k5, v5, k_new, v_new, slots, backend=backend,
                                   interpret=INTERPRET, layer=1)
    want_k, want_v = kv_cache_update(k4, v4, k_new, v_new, slots, backend="reference")
    for got, whole, want in ((got_k, k5, want_k), (got_v, v5, want_v)):
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(whole[0]))
        np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(whole[2]))
    with pytest.raises(ValueError, match="layer=3 is out of range"):
        kv_cache_update(k5, v5, k_new, v_new, slots, layer=3)
    with pytest.raises(ValueError, match="num_layers"):
        kv_cache_update(k4, v4, k_new, v_new, slots, layer=0)
