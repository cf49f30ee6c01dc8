"""The C++ CPU quantized matmuls against the jnp reference, and the weight checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpage.models.quantize import QuantFormat, quantize
from pallas_kernels.dense_matmul import cpu as dense_cpu
from pallas_kernels.quantized_matmul import (cpu_kernel_reads, dequantize, gather_columns,
                                             pack_panels, quantized_matmul, unpack_panels,
                                             weight_shape)
from pallas_kernels.quantized_matmul import cpu, reference


def _weight(bits: int | str, k: int, n: int, groups: int, seed: int = 0) -> dict:
    """``bits`` 8 (symmetric int8), "8z" (asymmetric int8: with a zero) or 4."""
    rng = np.random.default_rng(seed)
    if bits == "8z":  # as the int8 mode stores a projection
        w = rng.standard_normal((k, n), dtype=np.float32) + 0.5
        return {name: jnp.asarray(part)
                for name, part in quantize(w, QuantFormat(8, k // groups, zero=True)).items()}
    if bits == 8:
        return {"codes": jnp.asarray(rng.integers(-127, 128, (k, n), dtype=np.int8)),
                "scale": jnp.asarray(rng.random((groups, n), dtype=np.float32) / 100)}
    return {"codes": jnp.asarray(rng.integers(0, 256, (k // 2, n), dtype=np.uint8)),
            "scale": jnp.asarray(rng.random((groups, n), dtype=np.float32) / 10),
            "zero": jnp.asarray(rng.standard_normal((groups, n), dtype=np.float32))}


@pytest.mark.skipif(not cpu.available(), reason="no C++ compiler")
@pytest.mark.parametrize("bits,groups", [(8, 1), (8, 4), ("8z", 1), ("8z", 4), (4, 3), (4, 12)])
@pytest.mark.parametrize("m", [1, 5, 7, 40, 129])
def test_cpu_kernels_match_the_reference(bits, groups, m):
    k, n = 96, 100  # n is not a multiple of the kernel's 64-column panels
    weight = _weight(bits, k, n, groups)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((m, k), dtype=np.float32))
    ours = np.asarray(jax.jit(lambda x, w: quantized_matmul(x, w, backend="cpu"))(x, weight))
    ref = np.asarray(reference.quantized_matmul(x, weight))
    assert ours.shape == (m, n)
    np.testing.assert_allclose(ours, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


def _gguf_like(bits: int | str, k: int, n: int, seed: int) -> dict:
    """Codes with float16 scales (and minimums), as GGUF's Q8_0 / Q4_1 blocks of 32 hold
    (and int8 codes with such a zero: each weight converts exactly too)."""
    weight = _weight(bits, k, n, k // 32, seed)
    return {name: (part.astype(jnp.float16).astype(jnp.float32) if name != "codes" else part)
            for name, part in weight.items()}


@pytest.mark.skipif(not (cpu.available() and dense_cpu.available()), reason="no C++ compiler")
@pytest.mark.parametrize("bits", [8, "8z", 4])
# 1-6 rows: one pass in registers; 7-18: two or three (4-bit; 8-bit: the buffered panel);
# 19 and more: the buffered panel
@pytest.mark.parametrize("m", [1, 6, 7, 12, 13, 18, 19, 48, 200])
@pytest.mark.parametrize("k,n", [(64, 192), (2304, 130)])  # K over one 2048-row chunk
def test_gguf_blocks_give_the_float_weights_products_bit_for_bit(bits, m, k, n):
    """With float16 scales each weight converts exactly; the sums are dense_matmul's on the
    dequantized floats, bit for bit, at any number of rows (the default model's blocks
    stay quantized on the CPU because of this)."""
    weight = _gguf_like(bits, k, n, seed=m)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((m, k), dtype=np.float32))
    floats = dequantize(weight)
    np.testing.assert_array_equal(np.asarray(floats), np.asarray(jax.jit(dequantize)(weight)))
    ours = np.asarray(jax.jit(cpu.quantized_matmul_cpu)(x, weight))
    dense = np.asarray(jax.jit(dense_cpu.dense_matmul_cpu)(x, floats))
    np.testing.assert_array_equal(ours, dense)
    # a row's products do not depend on the rows beside it
    np.testing.assert_array_equal(np.asarray(jax.jit(cpu.quantized_matmul_cpu)(x[:1], weight)),
                                  ours[:1])


def test_leading_axes_other_dtypes_and_empty_rows():
    weight = _weight(4, 64, 32, 2)
    x = jnp.ones((2, 3, 64), jnp.bfloat16)  # not float32: the jnp form
    out = quantized_matmul(x, weight)
    assert out.shape == (2, 3, 32) and out.dtype == jnp.bfloat16
    assert quantized_matmul(jnp.ones((0, 64)), weight).shape == (0, 32)


def test_gather_columns_is_an_embedding_lookup():
    weight = _weight(8, 16, 50, 1)
    ids = jnp.asarray([3, 0, 49, 3])
    table = np.asarray(dequantize(weight))                      # [hidden, vocab]
    np.testing.assert_array_equal(np.asarray(gather_columns(weight, ids, jnp.float32)),
                                  table[:, [3, 0, 49, 3]].T)


def test_bad_weights_are_refused():
    good = _weight(4, 64, 32, 2)
    with pytest.raises(ValueError, match="uint8"):  # 4-bit codes without a zero
        weight_shape({name: part for name, part in good.items() if name != "zero"})
    with pytest.raises(ValueError, match="uint8"):  # FP8 codes with a zero
        weight_shape({**good, "codes": good["codes"].astype(jnp.float8_e4m3fn)})
    with pytest.raises(ValueError, match="groups"):
        weight_shape({**good, "scale": jnp.ones((3, 32)), "zero": jnp.ones((3, 32))})
    with pytest.raises(ValueError, match="disagree on K"):
        quantized_matmul(jnp.ones((1, 63)), good)
    with pytest.raises(ValueError, match="backend"):
        quantized_matmul(jnp.ones((1, 64)), good, backend="tpu")


@pytest.mark.skipif(not cpu.available(), reason="no C++ compiler")
@pytest.mark.parametrize("bits", [8, "8z", 4])
@pytest.mark.parametrize("live", [0, 5, 9, 30])
def test_rows_past_the_live_count_are_skipped_as_zeros(bits, live):
    weight = _gguf_like(bits, 96, 150, seed=live)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((9, 96), dtype=np.float32))
    full = np.asarray(jax.jit(cpu.quantized_matmul_cpu)(x, weight))
    part = np.asarray(jax.jit(lambda x, w, r: quantized_matmul(x, w, backend="cpu", rows=r))(
        x, weight, jnp.int32(live)))
    shown = min(live, 9)
    np.testing.assert_array_equal(part[:shown], full[:shown])
    assert not part[shown:].any()


def test_packed_panels_round_trip_and_shapes():
    for bits in (8, "8z", 4):
        plain = _weight(bits, 96, 192, 3)
        packed = pack_panels(plain)
        assert packed["codes"].shape == ((3, 48, 64) if bits == 4 else (3, 96, 64))
        assert packed["scale"].shape == (3, 3, 64)
        assert "zero" not in plain or packed["zero"].shape == (3, 3, 64)
        assert weight_shape(packed) == weight_shape(plain) == (96, 192)
        back = unpack_panels(packed)
        for name in plain:
            np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(plain[name]))
        numpy_packed = pack_panels({k: np.asarray(v) for k, v in plain.items()})
        assert all(isinstance(v, np.ndarray) and v.flags.c_contiguous
                   for v in numpy_packed.values())
        for name in plain:
            np.testing.assert_array_equal(numpy_packed[name], np.asarray(packed[name]))
        np.testing.assert_array_equal(np.asarray(dequantize(packed)),
                                      np.asarray(dequantize(plain)))
        ids = jnp.asarray([0, 63, 64, 191, 100, 0])
        np.testing.assert_array_equal(np.asarray(gather_columns(packed, ids, jnp.float32)),
                                      np.asarray(gather_columns(plain, ids, jnp.float32)))
        # the jnp backend reads packed weights too
        x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 96), dtype=np.float32))
        np.testing.assert_array_equal(
            np.asarray(quantized_matmul(x, packed, backend="reference")),
            np.asarray(quantized_matmul(x, plain, backend="reference")))


def test_bad_packed_weights_are_refused():
    good = pack_panels(_weight(4, 64, 128, 2))
    with pytest.raises(ValueError, match="N a multiple of 64"):
        pack_panels(_weight(4, 64, 100, 2))
    with pytest.raises(ValueError, match="N a multiple of 64"):
        pack_panels(good)  # already packed
    with pytest.raises(ValueError, match="packed by panels"):
        weight_shape({**good, "scale": jnp.ones((2, 2, 32))})
    with pytest.raises(ValueError, match="packed by panels"):
        weight_shape({**good, "zero": jnp.ones((1, 2, 64))})
    with pytest.raises(ValueError, match="groups"):
        weight_shape({**good, "scale": jnp.ones((2, 3, 64)), "zero": jnp.ones((2, 3, 64))})


@pytest.mark.skipif(not cpu.available(), reason="no C++ compiler")
@pytest.mark.parametrize("bits", [8, "8z", 4])
# 1-6 rows in registers, 7-18 in passes (4-bit), the buffered panel from 19; K over a chunk
@pytest.mark.parametrize("m", [1, 6, 7, 13, 19, 48])
@pytest.mark.parametrize("k", [64, 2304])
def test_packed_panels_give_the_plain_layouts_products_bit_for_bit(bits, m, k):
    plain = _gguf_like(bits, k, 192, seed=m)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((m, k), dtype=np.float32))
    run = jax.jit(lambda x, w, r: quantized_matmul(x, w, backend="cpu", rows=r))
    live = max(1, m - 2)  # and the rows past the live count still come out as zeros
    ours = np.asarray(run(x, pack_panels(plain), jnp.int32(live)))
    np.testing.assert_array_equal(ours, np.asarray(run(x, plain, jnp.int32(live))))
    assert not ours[live:].any()


def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fma(a, b, c) in float32, one rounding, for a * b exact in float64 (int8 times
    float32): the float64 sum rounded to float32, corrected where that sum falls on a
    float32 midpoint but was itself rounded (TwoSum's error term breaks the tie)."""
    p, c = a.astype(np.float64) * b, c.astype(np.float64)
    s = p + c
    bv = s - p
    err = (p - (s - bv)) + (c - bv)  # s + err == p + c exactly
    out = s.astype(np.float32)
    toward = np.nextafter(out, np.where(s > out, np.inf, -np.inf).astype(np.float32))
    midpoint = (s != out) & ((out.astype(np.float64) + toward) / 2 == s)
    up = np.where(err > 0, np.maximum(out, toward), np.minimum(out, toward))
    return np.where(midpoint & (err != 0), up, out).astype(np.float32)


def test_the_cpu_kernels_read_int8_and_4_bit_codes():
    for bits in (8, "8z", 4):
        assert cpu_kernel_reads(_weight(bits, 64, 32, 2))
    fp8 = _weight(8, 64, 32, 2)
    assert not cpu_kernel_reads({**fp8, "codes": fp8["codes"].astype(jnp.float8_e4m3fn)})


@pytest.mark.skipif(not (cpu.available() and dense_cpu.available()), reason="no C++ compiler")
@pytest.mark.parametrize("m", [1, 4, 6, 7, 64])  # in registers up to 6 rows, then buffered
@pytest.mark.parametrize("packed", [False, True])
def test_asymmetric_int8_converts_each_weight_with_one_fma(m, packed):
    """With float32 scales q * scale is inexact: each weight is fma(q, scale, zero), one
    rounding (not q * scale + zero, two), and the sums are dense_matmul's on those floats."""
    k, n = 320, 192 if packed else 200  # plain: and a panel of 8 columns
    plain = _weight("8z", k, n, k // 32, seed=m)
    q = np.asarray(plain["codes"]).reshape(k // 32, 32, n)
    scale, zero = np.asarray(plain["scale"])[:, None], np.asarray(plain["zero"])[:, None]
    floats = _fma32(q, scale, zero).reshape(k, n)
    assert (floats != (q * scale + zero).reshape(k, n)).any()  # the two roundings differ
    weight = pack_panels(plain) if packed else plain
    x = jnp.asarray(np.random.default_rng(6).standard_normal((m, k), dtype=np.float32))
    run = jax.jit(lambda x, w, r: quantized_matmul(x, w, backend="cpu", rows=r))
    live = max(1, m - 1)
    ours = np.asarray(run(x, weight, jnp.int32(live)))
    dense = np.asarray(jax.jit(dense_cpu.dense_matmul_cpu)(x, jnp.asarray(floats)))
    np.testing.assert_array_equal(ours[:live], dense[:live])
    assert not ours[live:].any()


def _rounded_by_numpy(x: np.ndarray, qmax: float, group: int, fp8: bool) -> np.ndarray:
    """x [M, K] quantized per row and run of ``group`` inputs (amax / qmax) and back,
    written independently of ``activation_quant``: what compressed-tensors computes."""
    import ml_dtypes

    rows = x.reshape(-1, group).astype(np.float32)
    scale = np.maximum(np.abs(rows).max(-1, keepdims=True), 1e-12) / np.float32(qmax)
    q = rows / scale
    q = (np.clip(q, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) if fp8
         else np.clip(np.round(q), -128, 127))
    return (q * scale).reshape(x.shape)


@pytest.mark.parametrize("codes,scheme,groups", [("fp8", "dynamic", 1), ("fp8", "dynamic_group", 4),
                                                 ("int", "dynamic", 1), ("int", "dynamic_group", 2),
                                                 ("int4", "dynamic", 2)])   # W4A8: int8 inputs
def test_emulated_activations_are_rounded_before_the_weight_only_matmul(codes, scheme, groups):
    """Where no native W8A8 path runs (the CPU), ``emulate`` rounds x to its codes and back
    (per token, or per token and weight group) and multiplies the dequantized weight;
    without it the matmul is weight-only."""
    rng = np.random.default_rng(3)
    k, n = 128, 48
    x = rng.standard_normal((9, k), dtype=np.float32) * np.linspace(0.1, 4, k, dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32)
    fmt = (QuantFormat(4, k // groups) if codes == "int4" else
           QuantFormat(8, None if groups == 1 else k // groups, codes))
    weight = {part: jnp.asarray(value) for part, value in quantize(w, fmt).items()}
    dense = np.asarray(dequantize(weight))
    qmax = 448.0 if codes == "fp8" else 127.5
    rounded = _rounded_by_numpy(x, qmax, k // (groups if scheme == "dynamic_group" else 1),
                                codes == "fp8")
    assert np.abs(rounded - x).max() > 1e-3                  # the rounding is visible
    emulated = quantized_matmul(jnp.asarray(x), weight, activations=scheme, emulate=True)
    np.testing.assert_allclose(np.asarray(emulated), rounded @ dense, rtol=1e-5, atol=1e-4)
    plain = quantized_matmul(jnp.asarray(x), weight, activations=scheme)
    np.testing.assert_allclose(np.asarray(plain), x @ dense, rtol=1e-5, atol=1e-4)


def test_per_group_activations_need_a_grouped_weight():
    with pytest.raises(ValueError, match="unsupported quantized format"):
        QuantFormat(8, None, "fp8", activations="dynamic_group")
    with pytest.raises(ValueError, match="unsupported quantized format"):
        QuantFormat(8, 32, "fp8", emulated=True)           # nothing to emulate
    from pallas_kernels.quantized_matmul.activation_quant import round_trip
    with pytest.raises(ValueError, match="3 activation groups do not divide K=64"):
        round_trip(jnp.ones((2, 64)), "dynamic_group", jnp.float8_e4m3fn, 3)


def test_emulated_rounding_of_bfloat16_activations_is_done_in_bfloat16():
    """compressed-tensors scales and divides in the activations' dtype: a bfloat16 model's
    scale is ``max|x| / 448`` rounded to bfloat16, and so is each ``x / s``."""
    import ml_dtypes

    from pallas_kernels.quantized_matmul.activation_quant import round_trip

    bf16 = ml_dtypes.bfloat16
    x = (np.random.default_rng(5).standard_normal((6, 64)) * 3).astype(bf16)
    scale = (np.abs(x).max(-1, keepdims=True).astype(np.float32) / np.float32(448)).astype(bf16)
    scaled = (x.astype(np.float32) / scale.astype(np.float32)).astype(bf16)
    codes = scaled.astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    expected = (codes.astype(np.float32).astype(bf16).astype(np.float32)
                * scale.astype(np.float32)).astype(bf16)
    got = np.asarray(round_trip(jnp.asarray(x), "dynamic", jnp.float8_e4m3fn))
    assert got.dtype == bf16
    np.testing.assert_array_equal(got.astype(np.float32), expected.astype(np.float32))
