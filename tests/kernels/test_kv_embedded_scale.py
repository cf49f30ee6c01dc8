"""An int8 KV cache in the fused (TPU) layout keeps each token's scale codes in the parity
of its value's first 16 bytes (``kv_token_scale.encode_embedded``).

The codes must come back exactly, the keys must be the split layout's bytes, every value
byte must stay within a step of its value (half a step past the 16 carriers), and the
reference and the TPU kernel (interpret mode) must attend over the fused bytes as over the
values they stand for: the same attention as the split layout with the codes in arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_layout, kv_token_scale
from pallas_kernels.kv_quant import decode
from pallas_kernels.kv_token_scale import (embedded_codes, encode_embedded, encode_per_token,
                                           token_scale_values)
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.write_and_attend import write_and_attend
from tests.default_suite import SLOW, crossed
from tests.kernels.cases import make_case
from tests.kernels.mode import INTERPRET, require_backend
from tests.kernels.test_attention_kernels import rng_for

CARRIERS = 2 * kv_token_scale.EMBEDDED_BITS


def _sized(rng, shape):
    """Normal values, each token and head a thousand times apart in size."""
    size = 10.0 ** rng.uniform(-2, 1, shape[:-1])[..., None]
    return jnp.asarray(rng.standard_normal(shape) * size, jnp.float32)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_codes_ride_in_the_values_parity_and_come_back(head_dim):
    rng = np.random.default_rng(head_dim)
    k, v = _sized(rng, (40, 3, head_dim)), _sized(rng, (40, 3, head_dim))
    v = v.at[0, 0].set(0.0).at[1, 1, 5].set(1e5)       # an all-zero value, one saturating
    k_bytes, v_bytes = encode_embedded(k, v)
    want_k_bytes, k_codes = encode_per_token(k)
    _, v_codes = encode_per_token(v)
    np.testing.assert_array_equal(np.asarray(k_bytes), np.asarray(want_k_bytes))
    got_k_codes, got_v_codes = embedded_codes(v_bytes)
    np.testing.assert_array_equal(np.asarray(got_k_codes), np.asarray(k_codes))
    np.testing.assert_array_equal(np.asarray(got_v_codes), np.asarray(v_codes))
    scale = np.asarray(token_scale_values(v_codes))[..., None]              # [T, Hkv, 1]
    back = np.asarray(decode(v_bytes, "int8")) * scale
    err = np.abs(back - np.asarray(v)) / scale
    inside = np.ones(v.shape[:2], bool)
    inside[1, 1] = False                              # past the codes' range: saturates
    assert (err[..., :CARRIERS][inside] <= 1.0001).all()    # the carriers: one step
    assert (err[..., CARRIERS:][inside] <= 0.5001).all()    # the rest: half a step
    assert err[..., :CARRIERS][inside].mean() > 0.3          # (they do round coarser)
    # the saturating head: its carriers clip to the ends of int8 too (not wrapped around)
    codes_at = np.asarray(decode(v_bytes, "int8"))[1, 1]
    big = np.asarray(v)[1, 1] / scale[1, 1]
    assert codes_at[5] >= 126 and np.all(np.abs(codes_at) <= 128)
    np.testing.assert_array_less(np.abs(codes_at[:CARRIERS] - np.clip(big[:CARRIERS], -128, 127)),
                                 1.0001)


def test_too_small_a_head_is_refused():
    x = jnp.ones((2, 1, 8), jnp.float32)
    with pytest.raises(ValueError, match="head_dim=8 is too small"):
        encode_embedded(x, x)


def _embedded_case(seed, head_dim, num_kv_heads, lens=([1, 6, 2], [17, 6, 40])):
    """A case whose fused int8 cache holds the embedded bytes of sized keys and values;
    -> (case, q, fused cache, split bytes, split codes, float values, rest)."""
    rng = rng_for("kv-embedded", seed, head_dim, num_kv_heads)
    case = make_case(rng, *lens, num_q_heads=2 * num_kv_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, block_size=8)
    q, k, v, *rest = case.args(poisoned=False)
    size = jnp.asarray(10.0 ** rng.uniform(-2, 1, k.shape[:3]), jnp.float32)[..., None]
    flat = lambda x: (x * size).reshape(-1, *x.shape[2:])  # noqa: E731
    k_bytes, v_bytes = (b.reshape(k.shape) for b in encode_embedded(flat(k), flat(v)))
    codes = tuple(c.astype(jnp.uint8) for c in embedded_codes(v_bytes))
    values = tuple(decode(b, "int8") * token_scale_values(c)[..., None]
                   for b, c in zip((k_bytes, v_bytes), codes))
    return (case, q, kv_layout.fuse(k_bytes, v_bytes), (k_bytes, v_bytes), codes, values,
            rest)


def _close(got, want, n):
    want = np.asarray(want, np.float32)[:n]
    np.testing.assert_allclose(np.asarray(got, np.float32)[:n], want, rtol=2e-5,
                               atol=2e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("head_dim,num_kv_heads,backend", [
    # each of 64, 128 and 96 on one backend by default; 32, 256 and the rest: slow
    *crossed([(64, 2), (128, 1), (96, 2)], ["tpu", "reference"]),
    *(pytest.param(*shape, backend, marks=SLOW)
      for shape in [(32, 3), (256, 2)] for backend in ["tpu", "reference"])])
def test_attention_over_embedded_bytes_equals_attention_over_their_values(
        head_dim, num_kv_heads, backend):
    """head_dim 64 and 32: key and value share one 128-lane group (32: each padded to 64
    lanes); 128, 96 (padded to 128) and 256: their own lanes."""
    if backend != "reference":
        require_backend(backend)
    case, q, fused, split, codes, values, rest = _embedded_case(0, head_dim, num_kv_heads)
    kw = dict(sm_scale=head_dim ** -0.5)
    want = ragged_paged_attention(q, *values, *rest, backend="reference", **kw)
    as_split = ragged_paged_attention(q, *split, *rest, backend="reference", kv_format="int8",
                                      token_scales=codes, **kw)
    _close(as_split, want, case.num_real_tokens)
    got = jax.jit(lambda q, c, *r: ragged_paged_attention(
        q, c, None, *r, backend=backend, interpret=INTERPRET, kv_format="int8", **kw))(
        q, fused, *rest)
    _close(got, want, case.num_real_tokens)


@pytest.mark.parametrize("backend", ["reference", "tpu"])
def test_a_split_int8_cache_given_to_the_tpu_kernel_reads_without_embedded_codes(backend):
    """Split pages are fused by the TPU wrapper: their parities are no codes there."""
    if backend != "reference":
        require_backend(backend)
    case, q, fused, split, codes, values, rest = _embedded_case(1, 64, 2)
    plain = tuple(decode(b, "int8") for b in split)
    want = ragged_paged_attention(q, *plain, *rest, sm_scale=0.125, backend="reference")
    got = ragged_paged_attention(q, *split, *rest, sm_scale=0.125, backend=backend,
                                 interpret=INTERPRET, kv_format="int8")
    _close(got, want, case.num_real_tokens)


@pytest.mark.parametrize("head_dim,backend", crossed([64, 128], ["tpu", "reference"]))
def test_write_and_attend_on_a_fused_int8_cache(head_dim, backend):
    """New tokens encoded as the model encodes them, written into layer 1 of a fused
    cache and attended over: the split layout's attention with the codes in arrays."""
    if backend != "reference":
        require_backend(backend)
    rng = np.random.default_rng(head_dim)
    layers, blocks, block_size, hq, hkv = 2, 10, 16, 4, 2
    shape = (layers, blocks, block_size, hkv, head_dim)
    k_all, v_all = (_sized(rng, shape).reshape(-1, hkv, head_dim) for _ in range(2))
    k8, v8 = (b.reshape(shape) for b in encode_embedded(k_all, v_all))
    k_new, v_new = encode_embedded(_sized(rng, (3, hkv, head_dim)),
                                   _sized(rng, (3, hkv, head_dim)))
    q = jnp.asarray(rng.normal(size=(3, hq, head_dim)), jnp.float32)
    slots = jnp.asarray([20, 37, -1], jnp.int32)
    meta = (jnp.asarray([21, 38, 0], jnp.int32),
            jnp.asarray([[1, 2, 0], [4, 5, 6], [0, 0, 0]], jnp.int32),
            jnp.asarray([0, 1, 2, 2], jnp.int32), jnp.asarray([2], jnp.int32))
    kw = dict(layer=1, sm_scale=head_dim ** -0.5, kv_format="int8")
    codes = tuple(c.astype(jnp.uint8) for c in embedded_codes(v8))
    new_codes = tuple(c.astype(jnp.uint8) for c in embedded_codes(v_new))
    want, want_k, want_v, _ = write_and_attend(
        q, k_new, v_new, slots, k8, v8, *meta, backend="reference", token_scales=codes,
        new_token_scales=new_codes, **kw)
    got, fused, none = write_and_attend(q, k_new, v_new, slots, kv_layout.fuse(k8, v8), None,
                                        *meta, backend=backend, interpret=INTERPRET, **kw)
    assert none is None
    got_k, got_v = kv_layout.unfuse(fused, head_dim)
    np.testing.assert_array_equal(np.asarray(got_k), np.asarray(want_k))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    _close(got, want, 2)
