"""int8 queries times int8 key codes in the GPU kernel (``int8_queries``), interpret mode.

Unlike a tuning knob this changes the results: each query row (one token, one query
head) is rounded to int8 codes of its own scale, largest |value| / 127, to the nearest
code with ties up, and the scores are exact integer sums of code products times the two
scales. What is checked: the kernel computes exactly the attention of those rounded
queries (over token-scaled pages as the engine's int8 cache holds them, and over plain
int8 pages), it is not the unrounded attention, and other caches are refused.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kv_quant import decode
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
from tests.kernels.mode import INTERPRET, require_backend
from tests.kernels.test_kv_quant import _byte_case
from tests.kernels.test_kv_token_scale import LENS, _close, _token_case


def rounded_rows(q: jnp.ndarray) -> jnp.ndarray:
    """q [T, Hq, D] -> each row's int8 codes times its step, as the kernel rounds them."""
    q32 = q.astype(jnp.float32)
    step = jnp.maximum(jnp.abs(q32).max(-1, keepdims=True), 1e-30) * (1.0 / 127.0)
    return jnp.clip(jnp.floor(q32 / step + 0.5), -127.0, 127.0) * step


def test_token_scaled_pages_give_the_attention_of_the_rounded_queries():
    require_backend("gpu")
    case, q, caches, codes, values, rest = _token_case(LENS[2], 3)
    n = case.num_real_tokens
    want = ragged_paged_attention(rounded_rows(q), *values, *rest, sm_scale=0.125,
                                  backend="reference")
    got = ragged_paged_attention_gpu(q, *caches, *rest, sm_scale=0.125, interpret=INTERPRET,
                                     kv_format="int8", token_scales=codes, int8_queries=True)
    _close(got, want, n)
    unrounded = np.asarray(ragged_paged_attention(q, *values, *rest, sm_scale=0.125,
                                                  backend="reference"))[:n]
    gap = np.abs(np.asarray(got)[:n] - unrounded).max() / np.abs(unrounded).max()
    assert gap > 1e-4, gap   # the queries were rounded: not the float32 attention


@pytest.mark.parametrize("split,halves", [(None, False), (3, False), (3, True)],
                         ids=["one_split", "three_splits", "three_splits_float16_values"])
def test_plain_int8_pages_with_bfloat16_queries(split, halves):
    require_backend("gpu")
    case, q, k_bytes, v_bytes, rest = _byte_case("int8", LENS[1], 4)
    n = case.num_real_tokens
    qb = q.astype(jnp.bfloat16)
    want = np.asarray(ragged_paged_attention(
        rounded_rows(qb), decode(k_bytes, "int8"), decode(v_bytes, "int8"), *rest,
        sm_scale=0.125, backend="reference"))[:n]
    got = np.asarray(ragged_paged_attention_gpu(
        qb, k_bytes, v_bytes, *rest, sm_scale=0.125, interpret=INTERPRET, kv_format="int8",
        int8_queries=True, num_kv_splits=split, block_kv=4, half_products=halves),
        np.float32)[:n]
    # exact scores; the probabilities (float16 or bfloat16) and the output are rounded to
    # bfloat16 (2^-8)
    assert np.abs(got - want).max() <= 8e-3 * np.abs(want).max()


@pytest.mark.parametrize("kv_format", [None, "fp8_e4m3", "fp8_e5m2"])
def test_other_caches_are_refused(kv_format):
    case, q, k_bytes, v_bytes, rest = _byte_case("int8", LENS[0], 5)
    k, v = (k_bytes, v_bytes) if kv_format else (decode(k_bytes, "int8"),) * 2
    with pytest.raises(ValueError, match="int8_queries.*kv_format='int8'"):
        ragged_paged_attention_gpu(q, k, v, *rest, sm_scale=0.125, interpret=True,
                                   kv_format=kv_format, int8_queries=True)
