"""The decode memory roofline arithmetic, on Llama-3-8B's published shape."""

import pytest

import bench_roofline
from jaxpage.models.presets import preset_config
from jaxpage.models.registry import resolve_architecture


def test_llama3_8b_decode_bytes_match_its_parameter_count():
    arch = resolve_architecture(preset_config("preset:llama3-8b"))[1]
    weights, kv_per_token = bench_roofline.decode_bytes(arch, "bfloat16")
    # Llama-3-8B has 8.03e9 parameters; decode reads all but the 128256 x 4096 embedding.
    assert weights / 2 == pytest.approx(8.03e9 - 128256 * 4096, rel=0.005)
    assert kv_per_token == 32 * 2 * 8 * 128 * 2   # layers x (k, v) x kv heads x head_dim x bf16
    roof = bench_roofline.roofline(arch, "bfloat16", batch=256, context=1088, bandwidth=3.35e12)
    step_s = (weights + 256 * 1088 * kv_per_token) / 3.35e12
    assert roof["roofline_output_tokens_per_s"] == pytest.approx(256 / step_s)


def test_peak_bandwidth_by_device_kind():
    assert bench_roofline.peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert bench_roofline.peak_bandwidth("NVIDIA H200") == 4.8e12
    assert bench_roofline.peak_bandwidth("cpu") is None
