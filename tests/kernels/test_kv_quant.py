"""Byte KV caches (int8 / fp8): every attention backend reads exactly what ``decode`` says.

Attention over a byte cache must equal attention over the float cache its bytes stand for
(the same math, so float32 tolerances), for the reference, the C++ CPU kernel (read-only
and fused write-and-attend) and the Pallas kernels in interpret mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_quant import KV_FORMATS, decode, encode, lookup_table
from pallas_kernels.ragged_paged_attention import cpu, ragged_paged_attention
from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
from pallas_kernels.write_and_attend import write_and_attend
from tests.default_suite import crossed
from tests.kernels.cases import make_case
from tests.kernels.mode import BACKENDS, INTERPRET, require_backend
from tests.kernels.test_attention_kernels import rng_for
from tests.kernels.test_write_and_attend import NUM_LAYERS, layered

FORMATS = list(KV_FORMATS)
SPREAD = {"int8": 40.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0}  # use the format's range


@pytest.mark.parametrize("kv_format", FORMATS)
def test_bytes_round_trip_and_saturate(kv_format):
    table = lookup_table(kv_format)
    every_byte = jnp.arange(256, dtype=jnp.uint8)
    finite = np.isfinite(np.asarray(decode(every_byte, kv_format)))
    np.testing.assert_array_equal(table[finite], np.asarray(decode(every_byte, kv_format))[finite])
    x = jnp.asarray([0.0, 1.0, -2.0, 1e9, -1e9, 3.4])
    back = np.asarray(decode(encode(x, kv_format), kv_format))
    limit = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}[kv_format]
    assert back[3] == limit and back[4] == -limit  # saturates, never inf or NaN
    assert back[0] == 0 and back[1] == 1 and back[2] == -2
    if kv_format == "int8":
        assert back[5] == 3.0


def _byte_case(kv_format, lens, seed):
    rng = rng_for("kv-bytes", kv_format, str(lens), seed)
    case = make_case(rng, *lens, num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=4)
    q, k, v, *rest = case.args(poisoned=False)
    k_bytes = encode(k * SPREAD[kv_format], kv_format)
    v_bytes = encode(v * SPREAD[kv_format], kv_format)
    return case, q, k_bytes, v_bytes, rest


LENS = [([1, 1, 1], [9, 16, 4]), ([5, 0, 3], [5, 7, 11]), ([1, 6, 2], [17, 6, 40])]


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("lens", LENS)
def test_attention_over_bytes_equals_attention_over_their_values(kv_format, lens):
    case, q, k_bytes, v_bytes, rest = _byte_case(kv_format, lens, 0)
    want = ragged_paged_attention(q, decode(k_bytes, kv_format), decode(v_bytes, kv_format),
                                  *rest, sm_scale=0.125, backend="reference")
    n = case.num_real_tokens
    backends = ["reference"] + (["cpu"] if cpu.available() else [])
    for backend in backends:
        got = jax.jit(lambda q, k, v, *r: ragged_paged_attention(
            q, k, v, *r, sm_scale=0.125, backend=backend, kv_format=kv_format))(
                q, k_bytes, v_bytes, *rest)
        np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n], rtol=2e-5,
                                   atol=2e-5 * float(np.abs(np.asarray(want)[:n]).max()),
                                   err_msg=backend)


@pytest.mark.skipif(not cpu.available(), reason="no C++ compiler for the kernel")
@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("layer", [0, NUM_LAYERS - 1])
def test_fused_cpu_write_and_attend_over_bytes(kv_format, layer):
    rng = rng_for("kv-bytes-fused", kv_format, layer)
    case = make_case(rng, [1, 6, 2], [17, 6, 40], num_q_heads=6, num_kv_heads=2, block_size=4)
    q, k_new, v_new, slots, k_all, v_all, rest = layered(case, rng, layer)
    enc = lambda x: encode(jnp.nan_to_num(x) * SPREAD[kv_format], kv_format)  # noqa: E731
    args = (q, enc(k_new), enc(v_new), slots, enc(k_all), enc(v_all), *rest)
    kw = dict(layer=layer, sm_scale=0.125, kv_format=kv_format)
    want = write_and_attend(*args, backend="reference", **kw)
    got = jax.jit(lambda *a: write_and_attend(*a, backend="cpu", **kw))(*args)
    n = case.num_real_tokens
    scale = float(np.abs(np.asarray(want[0])[:n]).max())
    np.testing.assert_allclose(np.asarray(got[0])[:n], np.asarray(want[0])[:n], rtol=2e-5,
                               atol=2e-5 * scale)
    for got_cache, want_cache in zip(got[1:], want[1:]):
        assert got_cache.dtype == jnp.uint8
        np.testing.assert_array_equal(np.asarray(got_cache), np.asarray(want_cache))


def test_byte_caches_need_their_format_and_float_caches_none():
    case, q, k_bytes, v_bytes, rest = _byte_case("int8", LENS[0], 1)
    with pytest.raises(ValueError, match="kv_format=None"):
        ragged_paged_attention(q, k_bytes, v_bytes, *rest, sm_scale=0.1)
    with pytest.raises(ValueError, match="kv_format='int8'"):
        ragged_paged_attention(q, decode(k_bytes, "int8"), decode(v_bytes, "int8"), *rest,
                               sm_scale=0.1, kv_format="int8")
    with pytest.raises(ValueError, match="kv_format='int4'"):
        ragged_paged_attention(q, k_bytes, v_bytes, *rest, sm_scale=0.1, kv_format="int4")


@pytest.mark.parametrize("layered_cache,kv_format,backend", crossed(  # one backend by default
    [(layered, kv_format) for layered in [False, True] for kv_format in FORMATS], BACKENDS))
def test_pallas_kernels_over_bytes(backend, kv_format, layered_cache):
    require_backend(backend)
    case, q, k_bytes, v_bytes, rest = _byte_case(kv_format, LENS[2], 2)
    want = ragged_paged_attention(q, decode(k_bytes, kv_format), decode(v_bytes, kv_format),
                                  *rest, sm_scale=0.125, backend="reference")
    kw = dict(sm_scale=0.125, backend=backend, interpret=INTERPRET, kv_format=kv_format)
    if layered_cache:  # the layer's pages of every layer's cache, read in place
        k_all = jnp.stack([jnp.zeros_like(k_bytes), k_bytes])
        v_all = jnp.stack([jnp.zeros_like(v_bytes), v_bytes])
        got = ragged_paged_attention(q, k_all, v_all, *rest, layer=1, **kw)
    else:
        got = ragged_paged_attention(q, k_bytes, v_bytes, *rest, **kw)
    n = case.num_real_tokens
    np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n], rtol=2e-5,
                               atol=2e-5 * float(np.abs(np.asarray(want)[:n]).max()))


@pytest.mark.parametrize("tuning,kv_format", crossed(  # each tuning on one format by default
    [dict(prefetch=True, num_stages=1, block_kv=16, target_programs=4096),
     dict(fp8_in_integers=True),  # what an A100 runs for e4m3 (no FP8 conversion there)
     dict(direct_io=False, mask_split=False, block_kv=32)],
    FORMATS, first_ids=["prefetch_split", "fp8_in_integers", "tiled_masked"]))
def test_gpu_kernel_tunings_over_bytes(kv_format, tuning):
    """The GPU kernel's tilings for byte caches (``gpu_config``), interpret mode."""
    require_backend("gpu")
    case, q, k_bytes, v_bytes, rest = _byte_case(kv_format, LENS[2], 2)
    want = ragged_paged_attention(q, decode(k_bytes, kv_format), decode(v_bytes, kv_format),
                                  *rest, sm_scale=0.125, backend="reference")
    got = ragged_paged_attention_gpu(q, k_bytes, v_bytes, *rest, sm_scale=0.125,
                                     interpret=INTERPRET, kv_format=kv_format, **tuning)
    n = case.num_real_tokens
    np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n], rtol=2e-5,
                               atol=2e-5 * float(np.abs(np.asarray(want)[:n]).max()))


@pytest.mark.parametrize("backend", ["reference", "cpu"] + BACKENDS)
@pytest.mark.parametrize("kv_format", ["int8", "fp8_e4m3"])
def test_scales_per_head_and_channel(backend, kv_format):
    """Bytes standing for ``scale * value``: the C++ kernel multiplies the scales in as it
    converts pages, the others get them folded into q and the output."""
    if backend == "cpu" and not cpu.available():
        pytest.skip("no C++ compiler for the kernel")
    if backend in ("gpu", "tpu"):
        require_backend(backend)
    case, q, k_bytes, v_bytes, rest = _byte_case(kv_format, LENS[1], 3)
    rng = np.random.default_rng(7)
    k_scale = jnp.asarray(rng.uniform(0.01, 0.2, k_bytes.shape[-2:]).astype(np.float32))
    v_scale = jnp.asarray(rng.uniform(0.01, 0.2, v_bytes.shape[-2:]).astype(np.float32))
    want = ragged_paged_attention(q, decode(k_bytes, kv_format) * k_scale,
                                  decode(v_bytes, kv_format) * v_scale, *rest, sm_scale=0.125,
                                  backend="reference")
    kw = dict(sm_scale=0.125, backend=backend, kv_format=kv_format, k_scale=k_scale,
              v_scale=v_scale, **({"interpret": INTERPRET} if backend in ("gpu", "tpu") else {}))
    got = jax.jit(lambda *a: ragged_paged_attention(*a, **kw))(q, k_bytes, v_bytes, *rest)
    n = case.num_real_tokens
    np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n], rtol=3e-5,
                               atol=3e-5 * float(np.abs(np.asarray(want)[:n]).max()))
    if backend == "cpu":  # the fused call too, against the scatter + reference path
        k_all, v_all = jnp.stack([k_bytes, k_bytes]), jnp.stack([v_bytes, v_bytes])
        slots = jnp.full((q.shape[0],), -1, jnp.int32)  # nothing new: attention only
        new = jnp.zeros((q.shape[0],) + k_bytes.shape[-2:], jnp.uint8)
        wkw = dict(layer=1, sm_scale=0.125, kv_format=kv_format, k_scale=k_scale, v_scale=v_scale)
        fused = write_and_attend(q, new, new, slots, k_all, v_all, *rest, backend="cpu", **wkw)
        plain = write_and_attend(q, new, new, slots, k_all, v_all, *rest, backend="reference",
                                 **wkw)
        np.testing.assert_allclose(np.asarray(fused[0])[:n], np.asarray(plain[0])[:n],
                                   rtol=3e-5, atol=3e-5 * float(np.abs(np.asarray(want)[:n]).max()))


def test_e4m3_bytes_decoded_in_integers_are_the_fp8_values():
    """``decode_in_integers`` (an A100's Triton has no FP8 conversion) gives every e4m3fn
    byte's value exactly, subnormals and both zeros included (NaN bytes are never written)."""
    from pallas_kernels.kv_quant import decode, decode_in_integers

    stored = jnp.arange(256, dtype=jnp.uint8)
    want = np.asarray(decode(stored, "fp8_e4m3"))
    got = np.asarray(decode_in_integers(stored, "fp8_e4m3"))
    finite = np.isfinite(want)
    assert finite.sum() == 254                                   # 0x7f and 0xff are NaN
    np.testing.assert_array_equal(got[finite], want[finite])
    np.testing.assert_array_equal(np.signbit(got[finite]), np.signbit(want[finite]))
