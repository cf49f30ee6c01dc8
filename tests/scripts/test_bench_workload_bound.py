"""The workload bound's arithmetic, on a made-up model shape and hand-counted steps."""

import pytest

import bench_workload_bound as wb

SHAPES = {"hidden": 4, "intermediate": 8, "q": 4, "kv": 2, "layers": 3, "vocab": 10}


def test_layer_flops_count_every_projection():
    # fused qkv 4x8, o 4x4, gate+up 4x16, down 8x4
    assert wb.layer_matrices(SHAPES) == [(4, 8), (4, 4), (4, 16), (8, 4)]


def test_prefill_is_compute_bound_and_each_decode_step_takes_the_slower_bound():
    layer = 2 * 3 * (32 + 16 + 64 + 32)          # FLOPs per token through the layers
    head = 2 * 4 * 10                            # FLOPs per sampled token
    weight_bytes = 4 * (3 * 144 + 40)
    peak, bandwidth = 1e3, 1e3
    got = wb.bound(SHAPES, prompt_lens=[5, 7], output_lens=[3, 1], max_num_seqs=8,
                   peak=peak, bandwidth=bandwidth)
    assert got["prefill_s"] == pytest.approx((12 * layer + 2 * head) / peak)
    # Outputs 3 and 1: the first token comes with the prefill; steps t=1, 2 have one row live.
    step = max((layer + head) / peak, weight_bytes / bandwidth)
    assert got["decode_s"] == pytest.approx(2 * step)
    assert got["bound_output_tokens_per_s"] == pytest.approx(4 / (got["prefill_s"] + 2 * step))


def test_requests_beyond_max_num_seqs_decode_in_a_later_wave():
    one_wave = wb.bound(SHAPES, [4] * 4, [5] * 4, max_num_seqs=4, peak=1e3, bandwidth=1e9)
    two_waves = wb.bound(SHAPES, [4] * 4, [5] * 4, max_num_seqs=2, peak=1e3, bandwidth=1e9)
    assert two_waves["decode_s"] == pytest.approx(one_wave["decode_s"])  # compute-bound
    slow_memory = wb.bound(SHAPES, [4] * 4, [5] * 4, max_num_seqs=2, peak=1e12, bandwidth=1.0)
    assert slow_memory["decode_s"] == pytest.approx(8 * 4 * 472)  # 8 steps, each reads 1888 B
