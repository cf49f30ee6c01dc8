"""Per-token scales of an int8 KV cache (``kv_token_scale``): the codes round up to the
scale each token needs, and every backend reads bytes x their token's scale.

Attention over token-scaled bytes must equal attention over the float values they stand
for, for the reference, the C++ CPU kernel (read-only and write-and-attend, which also
writes the codes) and the Pallas GPU kernel in interpret mode; the TPU backend falls back
to the reference for split caches with token scales (its fused int8 rows carry their
codes in the value bytes: test_kv_embedded_scale.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_token_scale
from pallas_kernels.kv_quant import decode
from pallas_kernels.kv_token_scale import encode_per_token, token_scale_values
from pallas_kernels.ragged_paged_attention import cpu, ragged_paged_attention
from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
from pallas_kernels.write_and_attend import write_and_attend
from tests.default_suite import crossed
from tests.kernels.cases import make_case
from tests.kernels.mode import BACKENDS, INTERPRET, require_backend
from tests.kernels.test_attention_kernels import rng_for
from tests.kernels.test_write_and_attend import NUM_LAYERS, layered


def test_codes_round_up_to_each_tokens_scale():
    rng = np.random.default_rng(0)
    # tokens and heads of very different sizes, one all zero, one past the codes' range
    x = rng.standard_normal((6, 3, 64)).astype(np.float32)
    x *= np.asarray([1e-5, 0.1, 1.0, 100.0, 0.0, 1e5], np.float32)[:, None, None]
    values, codes = encode_per_token(jnp.asarray(x))
    assert values.dtype == codes.dtype == jnp.uint8 and codes.shape == (6, 3)
    scale = np.asarray(token_scale_values(codes))                           # [T, Hkv]
    np.testing.assert_array_equal(scale, kv_token_scale.table()[np.asarray(codes)])
    needed = np.abs(x).max(-1) / 127
    table = kv_token_scale.table()
    inside = (needed >= table[0]) & (needed <= table[255])
    assert inside[1:4].all() and not inside[[0, 4, 5]].any()  # 1e-5 and 1e5: past the ends
    assert (scale[inside] >= needed[inside]).all()                # nothing saturates
    assert (scale[inside] < needed[inside] * 2 ** (1 / kv_token_scale.STEPS) * 1.0001).all()
    assert (np.asarray(codes)[[0, 4]] == 0).all() and (np.asarray(codes)[5] == 255).all()
    back = np.asarray(decode(values, "int8")) * scale[..., None]
    err = np.abs(back - x)[inside]
    assert (err <= scale[inside][..., None] / 2 * 1.0001).all()      # rounding, half a step


def _token_case(lens, seed):
    rng = rng_for("kv-token-scales", str(lens), seed)
    case = make_case(rng, *lens, num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=4)
    q, k, v, *rest = case.args(poisoned=False)
    # tokens a thousand times apart in size: what one scale per channel cannot hold
    size = jnp.asarray(10.0 ** rng.uniform(-2, 1, k.shape[:3]), jnp.float32)[..., None]
    k_bytes, k_codes = encode_per_token((k * size).reshape(-1, *k.shape[2:]))
    v_bytes, v_codes = encode_per_token((v * size).reshape(-1, *v.shape[2:]))
    shape, code_shape = k.shape, k.shape[:3]
    caches = (k_bytes.reshape(shape), v_bytes.reshape(shape))
    codes = (k_codes.reshape(code_shape), v_codes.reshape(code_shape))
    values = tuple(decode(b, "int8") * token_scale_values(c)[..., None]
                   for b, c in zip(caches, codes))
    return case, q, caches, codes, values, rest


LENS = [([1, 1, 1], [9, 16, 4]), ([5, 0, 3], [5, 7, 11]), ([1, 6, 2], [17, 6, 40])]


def _close(got, want, n, err_msg=""):
    want = np.asarray(want)[:n]
    np.testing.assert_allclose(np.asarray(got)[:n], want, rtol=2e-5,
                               atol=2e-5 * float(np.abs(want).max()), err_msg=err_msg)


@pytest.mark.parametrize("backend,lens", crossed(  # each backend on one batch by default
    ["reference", "cpu"] + BACKENDS, [(lens,) for lens in LENS],
    second_ids=[f"lens{i}" for i in range(len(LENS))]))
def test_attention_over_token_scaled_bytes_equals_attention_over_their_values(lens, backend):
    if backend == "cpu" and not cpu.available():
        pytest.skip("no C++ compiler for the kernel")
    if backend in BACKENDS:
        require_backend(backend)
    case, q, caches, codes, values, rest = _token_case(lens, 0)
    want = ragged_paged_attention(q, *values, *rest, sm_scale=0.125, backend="reference")
    got = jax.jit(lambda q, k, v, codes, *r: ragged_paged_attention(
        q, k, v, *r, sm_scale=0.125, backend=backend, interpret=INTERPRET,
        kv_format="int8", token_scales=codes))(q, *caches, codes, *rest)
    _close(got, want, case.num_real_tokens, backend)


@pytest.mark.parametrize("backend", ["reference", "cpu"] + BACKENDS)
def test_token_scales_of_one_layer_of_every_layers_cache(backend):
    """``layer``: the pages and the codes of layer 1 read in place."""
    if backend == "cpu" and not cpu.available():
        pytest.skip("no C++ compiler for the kernel")
    if backend in BACKENDS:
        require_backend(backend)
    case, q, caches, codes, values, rest = _token_case(LENS[2], 1)
    want = ragged_paged_attention(q, *values, *rest, sm_scale=0.125, backend="reference")
    stack = lambda x: jnp.stack([jnp.full_like(x, 77), x])  # noqa: E731  layer 0: junk
    got = ragged_paged_attention(q, *map(stack, caches), *rest, layer=1, sm_scale=0.125,
                                 backend=backend, interpret=INTERPRET, kv_format="int8",
                                 token_scales=tuple(map(stack, codes)))
    _close(got, want, case.num_real_tokens, backend)


@pytest.mark.parametrize("tuning", [dict(prefetch=True, num_stages=1, block_kv=16,
                                         target_programs=4096),
                                    dict(direct_io=False, mask_split=False, block_kv=32)],
                         ids=["prefetch_split", "tiled_masked"])
def test_gpu_kernel_tunings_over_token_scales(tuning):
    require_backend("gpu")
    case, q, caches, codes, values, rest = _token_case(LENS[2], 2)
    want = ragged_paged_attention(q, *values, *rest, sm_scale=0.125, backend="reference")
    got = ragged_paged_attention_gpu(q, *caches, *rest, sm_scale=0.125, interpret=INTERPRET,
                                     kv_format="int8", token_scales=codes, **tuning)
    _close(got, want, case.num_real_tokens)


@pytest.mark.parametrize("layer", [0, NUM_LAYERS - 1])
def test_write_and_attend_writes_the_codes(layer):
    """Reference and C++ write the same bytes and codes, and attend alike; the codes of
    the new tokens land in their slots of ``layer``, nowhere else."""
    rng = rng_for("kv-token-write", layer)
    case = make_case(rng, [1, 6, 2], [17, 6, 40], num_q_heads=6, num_kv_heads=2, block_size=4)
    q, k_new, v_new, slots, k_all, v_all, rest = layered(case, rng, layer)
    encoded = [encode_per_token(jnp.nan_to_num(x).reshape(-1, *x.shape[-2:]))
               for x in (k_new, v_new, k_all, v_all)]
    (k_b, k_c), (v_b, v_c) = encoded[:2]
    k_cache, v_cache = (b.reshape(k_all.shape) for b, _ in encoded[2:])
    codes = tuple(c.reshape(k_all.shape[:-1]) for _, c in encoded[2:])
    args = (q, k_b, v_b, slots, k_cache, v_cache, *rest)
    kw = dict(layer=layer, sm_scale=0.125, kv_format="int8", new_token_scales=(k_c, v_c),
              token_scales=codes)
    want = write_and_attend(*args, backend="reference", **kw)
    assert len(want) == 4
    real = np.asarray(slots) >= 0
    block_size = k_all.shape[2]
    for written, new, before in zip(want[3], (k_c, v_c), codes):
        written, before = np.asarray(written), np.asarray(before).copy()
        flat = before[layer].reshape(-1, before.shape[-1])
        flat[np.asarray(slots)[real]] = np.asarray(new)[real]
        before[layer] = flat.reshape(before.shape[1:])
        np.testing.assert_array_equal(written, before)
    assert block_size == 4
    if not cpu.available():
        return
    got = jax.jit(lambda *a: write_and_attend(*a, backend="cpu", **kw))(*args)
    _close(got[0], want[0], case.num_real_tokens)
    for got_cache, want_cache in zip((*got[1:3], *got[3]), (*want[1:3], *want[3])):
        assert got_cache.dtype == jnp.uint8
        np.testing.assert_array_equal(np.asarray(got_cache), np.asarray(want_cache))


def test_token_scales_are_checked():
    case, q, caches, codes, values, rest = _token_case(LENS[0], 3)
    with pytest.raises(ValueError, match="token_scales need a split byte cache"):
        ragged_paged_attention(q, *values, *rest, sm_scale=0.1, token_scales=codes)
    with pytest.raises(ValueError, match="token_scales must be"):
        ragged_paged_attention(q, *caches, *rest, sm_scale=0.1, kv_format="int8",
                               token_scales=(codes[0], codes[1][:, :2]))
    with pytest.raises(ValueError, match="token_scales must be"):
        ragged_paged_attention(q, *caches, *rest, sm_scale=0.1, kv_format="int8",
                               token_scales=(codes[0], codes[1].astype(jnp.int32)))
