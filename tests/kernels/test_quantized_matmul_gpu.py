"""The GPU weight-only quantized matmul (``pallas_kernels/quantized_matmul/gpu.py``) in
Pallas interpret mode against the jnp reference: int8 with and without a zero, FP8, 4-bit,
groups of 16-256 code rows, several groups a loop step or one, K split over programs or
not (these small grids split K wherever the steps allow), ragged row counts, N of 64 or
128 a program. (Compiled for H100 / A100 in tests/compile/test_kernels_compile.py.)"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpage.models.quantize import QuantFormat, quantize
from pallas_kernels.quantized_matmul import reference
from tests.default_suite import crossed
from tests.kernels.quantized_cases import assert_kernel_matches_reference
from pallas_kernels.quantized_matmul.gpu import quantized_matmul_gpu, supported

CASES = [  # (format, K, N, M)
    (QuantFormat(8, 32), 256, 192, 5),                # 2 groups a step, N tiles of 64
    (QuantFormat(8, 32, zero=True), 512, 384, 20),    # our int8 (asymmetric, groups of 32)
    (QuantFormat(8, 128, zero=True), 1024, 128, 3),   # one group a step
    (QuantFormat(4, 32), 256, 128, 1),                # 16 code rows a group
    (QuantFormat(4, 128), 1024, 512, 40),             # AWQ / GPTQ's groups
    (QuantFormat(8, 256), 768, 64, 70),               # 3 groups: one a step; M past a tile
    (QuantFormat(8, 16), 48, 64, 2),                  # 3 groups of 16: one a step (a power of 2)
    (QuantFormat(8, 32, "fp8"), 256, 128, 9),         # block-scaled FP8 codes
]


CASE_IDS = [
    f"{f.codes}{f.bits}-g{f.group_size}-z{int(f.has_zero)}-{k}x{n}-m{m}" for f, k, n, m in CASES]


@pytest.mark.parametrize("fmt,k,n,m,dtype", crossed(  # each case in one dtype by default
    CASES, [jnp.float32, jnp.bfloat16], second_ids=["f32", "bf16"], first_ids=CASE_IDS))
def test_gpu_kernel_matches_the_reference(fmt, k, n, m, dtype):
    assert_kernel_matches_reference(
        lambda x, parts: quantized_matmul_gpu(x, parts, interpret=True, block_m=64), supported,
        fmt, k, n, m, dtype)


def test_what_the_gpu_kernel_does_not_take():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 96)).astype(np.float32)
    assert not supported(quantize(w, QuantFormat(8, 32)), 256, 96)           # N % 64
    w = rng.standard_normal((256, 128)).astype(np.float32)
    assert not supported(quantize(w, QuantFormat(8, None)), 256, 128)        # one group
    assert not supported(quantize(w, QuantFormat(8, 8)), 256, 128)           # 8-row groups
    assert not supported(quantize(w, QuantFormat(4, 16)), 256, 128)          # 8 code rows
    w = rng.standard_normal((288, 128)).astype(np.float32)
    assert not supported(quantize(w, QuantFormat(8, 96)), 288, 128)          # not a power of 2


def test_a_split_k_of_several_steps_each_matches_the_reference(monkeypatch):
    """K split over programs whose shares hold several loop steps each (the cases above
    split into one step each, or not at all): 8 steps of 2 groups, in 2 splits of 4."""
    import jax

    from pallas_kernels.quantized_matmul import gpu

    monkeypatch.setattr(gpu, "TARGET_PROGRAMS", 4)
    rng = np.random.default_rng(7)
    k, n, m = 512, 128, 3
    parts = {name: jnp.asarray(part) for name, part in
             quantize(rng.standard_normal((k, n)).astype(np.float32),
                      QuantFormat(8, 32, zero=True)).items()}
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    run = lambda x, w: gpu.quantized_matmul_gpu(x, w, interpret=True)  # noqa: E731
    assert "_k2" in str(jax.make_jaxpr(run)(x, parts))       # the kernel's name: 2 splits
    got = np.asarray(run(x, parts))
    want = np.asarray(reference.quantized_matmul(x, parts))
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()
