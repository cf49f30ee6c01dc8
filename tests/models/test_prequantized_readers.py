"""The pre-quantized readers on stored tensors built here, for the cases the tools' tiny
fixtures do not reach: GPTQ v1 zero points of 0 (stored with a borrow), act-order
without ``desc_act``, compressed-tensors int8 with a per-tensor scale, int4 stored one to an
int8 (W4A8), GPTQ act-order by group (``weight_g_idx``), refused configs."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from jaxpage.models.prequantized.compressed_tensors import CompressedTensors
from jaxpage.models.prequantized.gptq import GPTQ
from jaxpage.models.quantize import QuantFormat, dequantize

ROOT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "quantized")


def _pack(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Unsigned codes packed ``32 / bits`` to a uint32 along ``axis`` (code i in bits
    ``bits * i``): the layout the tools write."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint64), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, per)
    words = sum(v[..., i] << np.uint64(bits * i) for i in range(per))
    return np.moveaxis(words, -1, axis).astype(np.uint32)


def test_gptq_v1_zero_points_of_zero_survive_the_borrow():
    rng = np.random.default_rng(0)
    k, n, group = 64, 16, 32
    q = rng.integers(0, 16, (k, n))
    z = rng.integers(0, 16, (k // group, n))
    z[0, :3] = 0                                   # v1 cannot write 0 - 1 in a nibble alone
    scale = rng.uniform(0.01, 0.1, (k // group, n)).astype(np.float16)
    words = _pack(z, 4, axis=1).astype(np.int64)
    v1 = ((words - 0x11111111) & 0xFFFFFFFF).astype(np.uint32).view(np.int32)  # with borrows
    tensors = {"m.qweight": _pack(q, 4, axis=0).view(np.int32), "m.qzeros": v1,
               "m.scales": scale}
    reader = GPTQ({"bits": 4, "group_size": group, "desc_act": False}, "x")
    fmt = reader.format_of("m", set(tensors))
    parts = reader.read(tensors.__getitem__, set(tensors), "m", fmt)
    want = (q - np.repeat(z, group, axis=0)) * np.repeat(scale.astype(np.float32), group, axis=0)
    np.testing.assert_allclose(dequantize(parts), want, rtol=0, atol=1e-6)


def test_gptq_act_order_rows_need_desc_act():
    rng = np.random.default_rng(1)
    k, n, group = 64, 8, 32
    g_idx = rng.permutation(np.arange(k) // group).astype(np.int32)
    tensors = {"m.qweight": _pack(rng.integers(0, 16, (k, n)), 4, axis=0).view(np.int32),
               "m.qzeros": _pack(np.full((2, n), 8), 4, axis=1).view(np.int32),
               "m.scales": np.ones((2, n), np.float16), "m.g_idx": g_idx}
    reader = GPTQ({"bits": 4, "group_size": group, "desc_act": False,
                   "checkpoint_format": "gptq_v2"}, "x")
    with pytest.raises(ValueError, match="desc_act"):
        reader.read(tensors.__getitem__, set(tensors), "m", reader.format_of("m", set(tensors)))


def test_compressed_tensors_int8_with_one_scale_per_tensor():
    rng = np.random.default_rng(2)
    w = rng.integers(-127, 128, (16, 64)).astype(np.int8)           # [N, K] as stored
    config = {"format": "int-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                           "strategy": "tensor"}}}}
    tensors = {"m.weight": w, "m.weight_scale": np.array([0.05], np.float32)}
    reader = CompressedTensors(config, "x")
    fmt = reader.format_of("m", set(tensors))
    assert fmt == QuantFormat(8, None)
    parts = reader.read(tensors.__getitem__, set(tensors), "m", fmt)
    np.testing.assert_allclose(dequantize(parts), w.T.astype(np.float32) * 0.05, rtol=1e-6)


@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_int4_stored_one_to_an_int8_with_int8_activations(symmetric):
    """llm-compressor's W4A8 (``int-quantized``): int4 values -8..7 each in an int8, group
    scales (and zero points), int8 activations per token: read as 4-bit codes, the
    activations rounded where not native (never: the weight is 4-bit). Values past 4 bits
    are refused."""
    rng = np.random.default_rng(4)
    w = rng.integers(-8, 8, (16, 64)).astype(np.int8)               # [N, K] as stored
    scale = rng.random((16, 2), dtype=np.float32) / 10               # [N, K / 32]
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group",
               "group_size": 32}
    acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
            "dynamic": True}
    config = {"format": "int-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": weights, "input_activations": acts}}}
    tensors = {"m.weight": w, "m.weight_scale": scale}
    expected = w.astype(np.float32)
    if not symmetric:
        zp = rng.integers(-2, 3, (16, 2)).astype(np.int8)
        tensors["m.weight_zero_point"] = zp
        expected = expected - np.repeat(zp, 32, axis=1)
    expected = (expected * np.repeat(scale, 32, axis=1)).T               # [K, N]
    reader = CompressedTensors(config, "x")
    fmt = reader.format_of("m", set(tensors))
    assert fmt == QuantFormat(4, 32, activations="dynamic", emulated=True)
    parts = reader.read(tensors.__getitem__, set(tensors), "m", fmt)
    np.testing.assert_allclose(dequantize(parts), expected, rtol=1e-6, atol=1e-7)
    tensors["m.weight"] = w * 2                                          # -16..14: not int4
    with pytest.raises(ValueError, match="outside 4-bit codes"):
        reader.read(tensors.__getitem__, set(tensors), "m", fmt)


@pytest.mark.parametrize("packed", [True, False])
def test_compressed_tensors_act_order_by_group_sorts_rows_and_keeps_the_order(packed):
    """GPTQ act-order by group (``actorder: "group"``, written by compressed-tensors before
    0.20): ``weight_g_idx`` [K] names each input row's group. The rows are sorted by group
    and the order kept (``perm``: x[..., perm] @ W), so the product is the stored one; a
    ``weight_g_idx`` out of order without ``actorder`` is refused, not ignored."""
    rng = np.random.default_rng(6)
    n, k = 16, 64
    q = rng.integers(0, 16, (n, k))                                  # unsigned codes
    g_idx = rng.permutation(np.arange(k) // 32).astype(np.int32)     # 32 rows a group
    scale = rng.random((n, 2), dtype=np.float32) / 10
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": 32, "actorder": "group"}
    if packed:
        fmt_name, tensors = "pack-quantized", {"m.weight_packed": _pack(q, 4, axis=1),
                                               "m.weight_shape": np.array([n, k])}
    else:
        fmt_name, tensors = "int-quantized", {"m.weight": (q - 8).astype(np.int8)}
    tensors.update({"m.weight_scale": scale, "m.weight_g_idx": g_idx})
    config = {"format": fmt_name, "config_groups": {"g": {"targets": ["Linear"],
                                                          "weights": weights}}}
    reader = CompressedTensors(config, "x")
    fmt = reader.format_of("m", set(tensors))
    assert fmt == QuantFormat(4, 32, act_order=True)
    parts = reader.read(tensors.__getitem__, set(tensors), "m", fmt)
    stored = ((q - 8) * scale[np.arange(n)[:, None], g_idx[None, :]]).T     # [K, N]
    perm = parts["perm"]
    np.testing.assert_array_equal(np.sort(perm), np.arange(k))
    assert np.all(np.diff(g_idx[perm]) >= 0)                          # sorted by group
    x = rng.standard_normal((3, k)).astype(np.float32)
    np.testing.assert_allclose(x[:, perm] @ dequantize(parts), x @ stored, rtol=1e-5, atol=1e-5)
    del weights["actorder"]
    reader = CompressedTensors(config, "x")
    with pytest.raises(ValueError, match="weight_g_idx orders the input rows"):
        reader.read(tensors.__getitem__, set(tensors), "m", reader.format_of("m", set(tensors)))


@pytest.mark.parametrize("extra", [{"transform_config": {"config_groups": {"r": {}}}},
                                   {"sparsity_config": {"format": "sparse-24-bitmask"}}])
def test_compressed_tensors_transforms_and_sparsity_are_refused(extra, tmp_path):
    from jaxpage import LLM

    folder = shutil.copytree(os.path.join(ROOT, "ct_w8a16_g32"), tmp_path / "model")
    with open(folder / "config.json") as f:
        config = json.load(f)
    config["quantization_config"].update(extra)
    with open(folder / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=next(iter(extra))):
        LLM(model=str(folder), max_model_len=64, num_kv_blocks=16, warmup=False)


def test_hf_fp8_blocks_cover_a_ragged_output_and_need_whole_input_blocks():
    """``weight_scale_inv`` is ``[ceil(N / bn), ceil(K / bk)]``: a last block of fewer
    output rows takes its scale like the others; an input size that is not a multiple of
    ``bk`` is refused (jaxpage's groups are whole), by name."""
    from jaxpage.models.prequantized.fp8 import HfFp8
    from jaxpage.models.quantize import FP8_DTYPE

    rng = np.random.default_rng(0)
    n, k, bn, bk = 40, 64, 16, 32                  # 3 output blocks, the last of 8 rows
    codes = rng.uniform(-400, 400, (n, k)).astype(FP8_DTYPE)
    scale = rng.uniform(0.001, 0.01, (3, 2)).astype(np.float32)
    tensors = {"m.weight": codes, "m.weight_scale_inv": scale}
    reader = HfFp8({"quant_method": "fp8", "weight_block_size": [bn, bk]}, "ckpt")
    fmt = reader.format_of("m", set(tensors))
    assert fmt == QuantFormat(8, bk, "fp8")
    parts = reader.read(tensors.__getitem__, set(tensors), "m", fmt)
    expected = codes.astype(np.float32) * np.repeat(np.repeat(scale, bn, 0)[:n], bk, 1)
    np.testing.assert_array_equal(dequantize(parts), expected.T)          # [K, N]
    ragged = {"m.weight": codes[:, :48], "m.weight_scale_inv": scale}       # K = 48
    with pytest.raises(ValueError, match="48 inputs, not a multiple of its scale block's 32"):
        reader.read(ragged.__getitem__, set(ragged), "m", fmt)
    with pytest.raises(ValueError, match=r"weight scale has shape \(3, 2\), not \(3, 1\)"):
        short = {"m.weight": codes[:, :32], "m.weight_scale_inv": scale}
        reader.read(short.__getitem__, set(short), "m", fmt)
