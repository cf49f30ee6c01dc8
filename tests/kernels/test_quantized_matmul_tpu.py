"""The TPU weight-only quantized matmul (``pallas_kernels/quantized_matmul/tpu.py``) in
Pallas TPU interpret mode against the jnp reference: int8 with and without a zero, 4-bit,
group sizes that tile K by 256-1,024 rows or take it whole, ragged row counts."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpage.models.quantize import QuantFormat, quantize
from tests.default_suite import crossed
from tests.kernels.quantized_cases import assert_kernel_matches_reference
from pallas_kernels.quantized_matmul.tpu import quantized_matmul_tpu, supported

CASES = [  # (format, K, N, M)
    (QuantFormat(8, 32), 256, 256, 5),
    (QuantFormat(8, 32, zero=True), 512, 384, 20),
    (QuantFormat(8, 128, zero=True), 2048, 128, 3),   # scale rows 8 per 1,024-row tile
    (QuantFormat(4, 32), 256, 128, 1),
    (QuantFormat(4, 128), 1024, 512, 40),
    (QuantFormat(8, 64), 576, 128, 7),                # K taken whole (SmolLM2's hidden)
]


CASE_IDS = [f"{f.bits}b-g{f.group_size}-z{int(f.has_zero)}-{k}x{n}-m{m}"
            for f, k, n, m in CASES]


@pytest.mark.parametrize("fmt,k,n,m,dtype", crossed(  # each case in one dtype by default
    CASES, [jnp.float32, jnp.bfloat16], second_ids=["f32", "bf16"], first_ids=CASE_IDS))
def test_tpu_kernel_matches_the_reference(fmt, k, n, m, dtype):
    assert_kernel_matches_reference(
        lambda x, parts: quantized_matmul_tpu(x, parts, interpret=True), supported,
        fmt, k, n, m, dtype)


def test_what_the_tpu_kernel_does_not_take():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 192)).astype(np.float32)
    assert not supported(quantize(w, QuantFormat(8, 32)), 256, 192)          # N % 128
    w = rng.standard_normal((256, 256)).astype(np.float32)
    assert not supported(quantize(w, QuantFormat(8, None)), 256, 256)        # one group
    assert not supported(quantize(w, QuantFormat(8, 4)), 256, 256)           # 4-row groups
