"""``write_and_attend``: one layer's KV write then attention, on every layer's caches.

The fused C++ CPU call (``backend="cpu"``) must give the attention of the unfused path
(XLA scatter + the reference attention) and exactly the same caches: the layer's new
rows in their slots, padding rows (slot -1) dropped, every other layer untouched. Under
``jit`` with a donated cache it must update the cache in place, also inside a decode-like
``while_loop`` of one token per step, where XLA used to copy the whole cache.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import cpu
from pallas_kernels.write_and_attend import write_and_attend
from tests.kernels.cases import make_case
from tests.kernels.test_attention_kernels import rng_for

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler for the kernel")

NUM_LAYERS = 3


def layered(case, rng, layer: int):
    """(q, k_new, v_new, slots, k_caches [L, ...], v_caches, rest) for ``case`` at ``layer``:
    the case's new tokens are removed from ``layer``'s pages (they come back through the
    write), the other layers hold random junk."""
    q, k, v, lens, tables, cu, num_seqs = case.args(poisoned=False)
    k, v = np.array(k), np.array(v)
    num_blocks, block_size, num_kv_heads, head_dim = k.shape
    num_tokens = q.shape[0]
    slots = np.full(num_tokens, -1, np.int32)
    cu_np, lens_np, tables_np = np.asarray(cu), np.asarray(lens), np.asarray(tables)
    for seq in range(int(num_seqs[0])):
        q_len = cu_np[seq + 1] - cu_np[seq]
        for i in range(q_len):
            pos = lens_np[seq] - q_len + i
            slots[cu_np[seq] + i] = tables_np[seq, pos // block_size] * block_size + pos % block_size
    flat_k, flat_v = k.reshape(-1, num_kv_heads, head_dim), v.reshape(-1, num_kv_heads, head_dim)
    k_new = np.zeros((num_tokens, num_kv_heads, head_dim), np.float32)
    v_new = np.zeros_like(k_new)
    real = slots >= 0
    k_new[real], v_new[real] = flat_k[slots[real]], flat_v[slots[real]]
    k_new[~real] = v_new[~real] = 7.0                  # padding rows: must not be written
    flat_k[slots[real]] = flat_v[slots[real]] = np.nan  # only the write may fill these
    shape = (NUM_LAYERS,) + k.shape
    k_all = rng.standard_normal(shape).astype(np.float32)
    v_all = rng.standard_normal(shape).astype(np.float32)
    k_all[layer], v_all[layer] = k, v
    return (q, jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(slots), jnp.asarray(k_all),
            jnp.asarray(v_all), (lens, tables, cu, num_seqs))


@pytest.mark.parametrize("layer", range(NUM_LAYERS))
@pytest.mark.parametrize("lens", [([1, 1, 1], [9, 16, 4]), ([5, 0, 3], [5, 7, 11]),
                                  ([1, 6, 2], [17, 6, 40])])
def test_fused_cpu_call_equals_scatter_then_reference(layer, lens):
    rng = rng_for("write-and-attend", layer, str(lens))
    case = make_case(rng, *lens, num_q_heads=6, num_kv_heads=2, block_size=4)
    q, k_new, v_new, slots, k_all, v_all, rest = layered(case, rng, layer)
    kw = dict(layer=layer, sm_scale=0.125)
    want = write_and_attend(q, k_new, v_new, slots, k_all, v_all, *rest, backend="reference", **kw)
    fused = jax.jit(lambda *a: write_and_attend(*a, backend="cpu", **kw))
    got = fused(q, k_new, v_new, slots, k_all, v_all, *rest)
    n = case.num_real_tokens
    np.testing.assert_allclose(np.asarray(got[0])[:n], np.asarray(want[0])[:n], rtol=2e-5, atol=2e-5)
    assert (np.asarray(got[0])[n:] == 0).all()
    for got_cache, want_cache, before in zip(got[1:], want[1:], (k_all, v_all)):
        got_cache, want_cache = np.asarray(got_cache), np.asarray(want_cache)
        np.testing.assert_array_equal(got_cache, want_cache)  # NaN where both left NaN
        others = [l for l in range(NUM_LAYERS) if l != layer]
        np.testing.assert_array_equal(got_cache[others], np.asarray(before)[others])
        assert not np.isnan(got_cache[layer]).any(), "every new token's slot is written"


def _cache_copies(hlo_text: str, cache_shape: tuple[int, ...]) -> list[str]:
    """Instructions of the optimized HLO that copy a whole cache: a ``copy`` of that
    shape, or a fusion named for one (``bitcast_copy_fusion``)."""
    dims = ",".join(map(str, cache_shape))
    pattern = re.compile(rf"%(\S+) = f32\[{dims}\]\{{[0-9,]*\}} (copy|fusion)\(")
    return [line.strip()[:160] for line in hlo_text.splitlines()
            if (m := pattern.search(line)) and (m.group(2) == "copy" or "copy" in m.group(1))]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_decode_loop_updates_the_cache_in_place(backend):
    """A while_loop of single-token steps through every layer, as the engine's decode loop
    runs them: the optimized program must not copy a cache (it did, twice per layer)."""
    rng = rng_for("write-and-attend-loop")
    case = make_case(rng, [1], [9], num_q_heads=4, num_kv_heads=2, block_size=4, pad_seqs=0,
                     pad_tokens=0)
    q, k_new, v_new, slots, k_all, v_all, rest = layered(case, rng, 0)

    def run(k_all, v_all, q, k_new, v_new, slots):
        def body(i, caches):
            k_all, v_all = caches
            for layer in range(NUM_LAYERS):
                _, k_all, v_all = write_and_attend(
                    q * (i + 1).astype(q.dtype), k_new, v_new, slots, k_all, v_all, *rest,
                    layer=layer, sm_scale=0.125, backend=backend)
            return k_all, v_all

        return jax.lax.fori_loop(0, 3, body, (k_all, v_all))

    compiled = jax.jit(run, donate_argnums=(0, 1)).lower(
        k_all, v_all, q, k_new, v_new, slots).compile()
    copies = _cache_copies(compiled.as_text(), tuple(k_all.shape))
    assert not copies, copies
    k_out, _ = compiled(k_all, v_all, q, k_new, v_new, slots)
    assert not np.isnan(np.asarray(k_out)[:, int(slots[0]) // 4]).any()


def test_bad_layer_and_cache_rank_are_value_errors():
    rng = rng_for("write-and-attend-errors")
    case = make_case(rng, [1], [5])
    q, k_new, v_new, slots, k_all, v_all, rest = layered(case, rng, 0)
    with pytest.raises(ValueError, match="layer=3 is out of range for 3 layers"):
        write_and_attend(q, k_new, v_new, slots, k_all, v_all, *rest, layer=3, sm_scale=1.0)
    with pytest.raises(ValueError, match=r"\[num_layers, num_blocks"):
        write_and_attend(q, k_new, v_new, slots, k_all[0], v_all[0], *rest, layer=0,
                         sm_scale=1.0)
    with pytest.raises(ValueError, match="k_new/v_new must be"):
        write_and_attend(q, k_new[:, :1], v_new, slots, k_all, v_all, *rest, layer=0,
                         sm_scale=1.0)
