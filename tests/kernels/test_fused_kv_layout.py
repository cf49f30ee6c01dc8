"""The TPU's fused KV layout (``pallas_kernels.kv_layout``): rows, kernels and the update.

The TPU attention kernel reads fused rows only (split caches are fused by its wrapper,
so every TPU test in ``test_attention_kernels.py`` runs it too); here it reads fused
caches directly at the shapes the layout is for: head_dim 64 (key and value share a
128-lane group), 128 and 256, one KV head per device, several, and byte caches. The
fused update (reference scatter and the Pallas read-modify-write kernel) must write
exactly what the split update writes.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels import kv_layout
from pallas_kernels.kv_cache_update import kv_cache_update
from pallas_kernels.kv_quant import encode
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.write_and_attend import write_and_attend
from tests.default_suite import SLOW, crossed
from tests.kernels.cases import make_case, random_lens, tolerance
from tests.kernels.mode import INTERPRET, require_backend

# (num_q_heads, num_kv_heads, head_dim): the head dims at 1 to 8 KV heads
SHAPES = [(4, 1, 64), (9, 3, 64), (4, 1, 128), (32, 8, 128), (8, 1, 256), (8, 2, 256),
          (2, 1, 80)]


@pytest.mark.parametrize("head_dim,half,width", [
    (64, 64, 128), (32, 64, 128), (128, 128, 256), (256, 256, 512), (80, 128, 256),
    (192, 256, 512)])
def test_a_fused_row_is_whole_128_lane_groups_per_head(head_dim, half, width):
    assert kv_layout.half_width(head_dim) == half
    assert kv_layout.row_width(1, head_dim) == width
    assert kv_layout.row_width(3, head_dim) == 3 * width
    assert kv_layout.heads_in_row(3 * width, head_dim) == 3
    with pytest.raises(ValueError, match="whole heads"):
        kv_layout.heads_in_row(width + 128, head_dim) if width > 128 else \
            kv_layout.heads_in_row(width // 2 * 3, head_dim)


def test_fuse_puts_each_heads_key_then_value_in_its_slot():
    k = jnp.arange(2 * 3 * 64, dtype=jnp.float32).reshape(2, 3, 64)       # [T, Hkv, D]
    v = -k - 1
    rows = np.asarray(kv_layout.fuse(k, v))                                 # [T, 3 * 128]
    assert rows.shape == (2, 384)
    np.testing.assert_array_equal(rows[1, 128:192], np.asarray(k[1, 1]))    # head 1's key
    np.testing.assert_array_equal(rows[1, 192:256], np.asarray(v[1, 1]))    # then its value
    back_k, back_v = kv_layout.unfuse(jnp.asarray(rows), 64)
    np.testing.assert_array_equal(back_k, k)
    np.testing.assert_array_equal(back_v, v)
    padded = np.asarray(kv_layout.fuse(k[..., :48], v[..., :48]))            # head_dim 48
    assert padded.shape == (2, 384) and (padded[:, 48:64] == 0).all()


def test_the_layout_follows_the_platform_and_the_override(monkeypatch):
    monkeypatch.delenv("JAXPAGE_KV_LAYOUT", raising=False)
    assert kv_layout.for_platform("tpu") == "fused"
    assert kv_layout.for_platform("gpu") == kv_layout.for_platform("cpu") == "split"
    monkeypatch.setenv("JAXPAGE_KV_LAYOUT", "fused")
    assert kv_layout.for_platform("cpu") == "fused"
    monkeypatch.setenv("JAXPAGE_KV_LAYOUT", "rows")
    with pytest.raises(ValueError, match="JAXPAGE_KV_LAYOUT='rows'"):
        kv_layout.for_platform("cpu")


def _fused_case(case, poisoned):
    q, k, v, *rest = case.args(poisoned)
    return (q, kv_layout.fuse(k, v), None, *rest)


# The default suite: four shapes (head dims 64, 128, 256 and 80; one, three and two KV
# heads a row), decode and mixed batches in turn; every shape in both with the slow cases
DEFAULT_KERNEL_CASES = {((9, 3, 64), "decode"), ((4, 1, 128), "mixed"),
                        ((8, 2, 256), "decode"), ((2, 1, 80), "mixed")}
KERNEL_CASES = [pytest.param(*shape, kind, id=f"{kind}-{'-'.join(map(str, shape))}",
                             marks=[] if (shape, kind) in DEFAULT_KERNEL_CASES else SLOW)
                for kind in ["decode", "mixed"] for shape in SHAPES]


@pytest.mark.parametrize("hq,hkv,head_dim,kind", KERNEL_CASES)
def test_tpu_kernel_reads_fused_pages(hq, hkv, head_dim, kind):
    require_backend("tpu")
    rng = np.random.default_rng(hq * 1000 + hkv * 100 + head_dim + len(kind))
    dtype = np.float32 if head_dim != 64 else jnp.bfloat16
    q_lens, kv_lens = random_lens(rng, kind, 3, 40, 16)
    case = make_case(rng, q_lens, kv_lens, num_q_heads=hq, num_kv_heads=hkv,
                     head_dim=head_dim, block_size=16, dtype=dtype)
    kw = dict(sm_scale=head_dim ** -0.5, soft_cap=20.0 if hkv == 3 else None,
              sliding_window=24 if hkv == 2 else None)
    want = ragged_paged_attention(*case.args(poisoned=False), backend="reference", **kw)
    reference = ragged_paged_attention(*_fused_case(case, False), backend="reference", **kw)
    np.testing.assert_array_equal(np.asarray(reference), np.asarray(want))
    got = np.asarray(ragged_paged_attention(*_fused_case(case, True), backend="tpu",
                                            interpret=INTERPRET, **kw)).astype(np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np.asarray(want).astype(np.float32), **tolerance(dtype))


def _caches(rng, layers, blocks, block_size, hkv, head_dim, dtype):
    shape = (layers, blocks, block_size, hkv, head_dim)
    k, v = (jnp.asarray(rng.normal(size=shape)).astype(dtype) for _ in range(2))
    return k, v


@pytest.mark.parametrize("hkv,head_dim,dtype,backend", crossed(  # each on one backend by default
    [(hkv, head_dim, dtype) for hkv, head_dim in [(1, 64), (3, 64), (1, 128), (2, 256)]
     for dtype in [jnp.float32, jnp.bfloat16, jnp.uint8]], ["reference", "tpu"]))
def test_the_fused_update_writes_what_the_split_update_writes(hkv, head_dim, dtype, backend):
    require_backend(backend) if backend != "reference" else None
    rng = np.random.default_rng(head_dim + hkv)
    k, v = _caches(rng, 2, 9, 16, hkv, head_dim, np.float32)
    if dtype == jnp.uint8:
        k, v = encode(k, "int8"), encode(v, "int8")
    else:
        k, v = k.astype(dtype), v.astype(dtype)
    # 13 tokens: runs within a block, two tokens in one 8-row group, a skipped slot, the
    # last slot of the cache, and a grid step of 8 tokens split across two
    slots = jnp.asarray([17, 18, 19, 33, -1, 40, 47, 48, 63, 100, 101, 9 * 16 - 1, 3],
                        jnp.int32)
    new = (len(slots), hkv, head_dim)
    k_new, v_new = (jnp.asarray(rng.normal(size=new)) for _ in range(2))
    if dtype == jnp.uint8:
        k_new, v_new = encode(k_new, "int8"), encode(v_new, "int8")
    else:
        k_new, v_new = k_new.astype(dtype), v_new.astype(dtype)
    want_k, want_v = kv_cache_update(k, v, k_new, v_new, slots, layer=1)
    fused, none = kv_cache_update(kv_layout.fuse(k, v), None, k_new, v_new, slots, layer=1,
                                  backend=backend, interpret=INTERPRET)
    assert none is None
    got_k, got_v = kv_layout.unfuse(fused, head_dim)
    np.testing.assert_array_equal(np.asarray(got_k), np.asarray(want_k))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))


@pytest.mark.parametrize("backend", ["reference", "tpu"])
def test_write_and_attend_on_a_fused_byte_cache(backend):
    """An fp8 fused cache, one KV head of 128: written, then read back by attention (an
    int8 one carries scale codes in its value bytes: test_kv_embedded_scale.py)."""
    require_backend(backend) if backend != "reference" else None
    rng = np.random.default_rng(7)
    layers, blocks, block_size, hq, hkv, d = 2, 10, 16, 4, 1, 128
    k, v = _caches(rng, layers, blocks, block_size, hkv, d, np.float32)
    k8, v8 = encode(k, "fp8_e4m3"), encode(v, "fp8_e4m3")
    k_new = encode(jnp.asarray(rng.normal(size=(3, hkv, d))), "fp8_e4m3")
    v_new = encode(jnp.asarray(rng.normal(size=(3, hkv, d))), "fp8_e4m3")
    q = jnp.asarray(rng.normal(size=(3, hq, d)), jnp.float32)
    args = (jnp.asarray([20, 37, -1], jnp.int32), )
    meta = (jnp.asarray([21, 38, 0], jnp.int32), jnp.asarray([[1, 2, 0], [4, 5, 6], [0, 0, 0]],
                                                               jnp.int32),
            jnp.asarray([0, 1, 2, 2], jnp.int32), jnp.asarray([2], jnp.int32))
    kw = dict(layer=1, sm_scale=d ** -0.5, kv_format="fp8_e4m3")
    want, want_k, want_v = write_and_attend(q, k_new, v_new, *args, k8, v8, *meta,
                                            backend="reference", **kw)
    got, fused, none = write_and_attend(q, k_new, v_new, *args, kv_layout.fuse(k8, v8), None,
                                        *meta, backend=backend, interpret=INTERPRET, **kw)
    assert none is None
    np.testing.assert_array_equal(np.asarray(kv_layout.unfuse(fused, d)[0]), np.asarray(want_k))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
