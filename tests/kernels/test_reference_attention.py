"""The plain-jnp ragged paged attention and KV update against a dense numpy oracle."""

import zlib

import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels.kv_cache_update import kv_cache_update
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from tests.default_suite import crossed


def dense_oracle(q, k_cache, v_cache, kv_lens, block_tables, q_lens, *, sm_scale,
                 sliding_window=None, soft_cap=None):
    """Attention per sequence with contiguous K/V, in float64."""
    num_kv_heads = k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    block_size = k_cache.shape[1]
    outs, start = [], 0
    for kv_len, table, q_len in zip(kv_lens, block_tables, q_lens):
        k = np.concatenate([k_cache[b] for b in table])[:kv_len].astype(np.float64)
        v = np.concatenate([v_cache[b] for b in table])[:kv_len].astype(np.float64)
        for t in range(q_len):
            pos = kv_len - q_len + t
            qt = q[start + t].astype(np.float64)                       # [Hq, D]
            kh = np.repeat(k, group, axis=1)                            # [L, Hq, D]
            vh = np.repeat(v, group, axis=1)
            s = np.einsum("hd,lhd->hl", qt, kh) * sm_scale
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            allowed = np.arange(kv_len) <= pos
            if sliding_window is not None:
                allowed &= np.arange(kv_len) > pos - sliding_window
            s = np.where(allowed[None], s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            outs.append(np.einsum("hl,lhd->hd", p, vh))
        start += q_len
    assert block_size > 0
    return np.stack(outs)


def build_case(rng, q_lens, kv_lens, *, block_size=4, num_q_heads=4, num_kv_heads=2,
               head_dim=8, num_blocks=40, max_num_seqs=None, token_pad=3):
    max_num_seqs = max_num_seqs or len(q_lens)
    blocks_per_seq = max(-(-k // block_size) for k in kv_lens)
    free = list(rng.permutation(np.arange(1, num_blocks)))           # permuted physical blocks
    tables = np.zeros((max_num_seqs, blocks_per_seq + 1), np.int32)
    for i, kv_len in enumerate(kv_lens):
        for j in range(-(-kv_len // block_size)):
            tables[i, j] = free.pop()
    k_cache = rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim)).astype(np.float32)
    v_cache = rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim)).astype(np.float32)
    num_tokens = sum(q_lens)
    q = rng.standard_normal((num_tokens + token_pad, num_q_heads, head_dim)).astype(np.float32)
    cu = np.full(max_num_seqs + 1, num_tokens, np.int32)
    cu[:len(q_lens) + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    lens = np.zeros(max_num_seqs, np.int32)
    lens[:len(kv_lens)] = kv_lens
    return q, k_cache, v_cache, lens, tables, cu, np.array([len(q_lens)], np.int32)


CASES = {
    "decode_only": ([1, 1, 1], [5, 16, 9]),
    "prefill_only": ([7, 4], [7, 4]),
    "mixed": ([1, 6, 1, 3], [13, 6, 4, 11]),
    "ends_on_block_boundary": ([4, 1], [8, 12]),
}


# each batch with one head grouping by default, all of them with the slow cases
@pytest.mark.parametrize("name,num_q_heads,num_kv_heads",
                         crossed(sorted(CASES), [(4, 4), (8, 2), (8, 1)]))
def test_reference_matches_dense_oracle(name, num_q_heads, num_kv_heads):
    rng = np.random.default_rng(zlib.crc32(f"{name}{num_q_heads}".encode()))
    q_lens, kv_lens = CASES[name]
    args = build_case(rng, q_lens, kv_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                      max_num_seqs=len(q_lens) + 2)
    q, k_cache, v_cache, lens, tables, cu, num_seqs = args
    out = np.asarray(ragged_paged_attention(*map(jnp.asarray, args), sm_scale=0.3,
                                            backend="reference"))
    want = dense_oracle(q, k_cache, v_cache, kv_lens, tables, q_lens, sm_scale=0.3)
    n = sum(q_lens)
    np.testing.assert_allclose(out[:n], want, rtol=1e-5, atol=1e-5)
    assert np.isfinite(out).all() and (out[n:] == 0).all()  # padding tokens come back zero


@pytest.mark.parametrize("sliding_window,soft_cap", [(3, None), (None, 5.0), (4, 2.0)])
def test_sliding_window_and_soft_cap(sliding_window, soft_cap):
    rng = np.random.default_rng(7)
    q_lens, kv_lens = [5, 1], [9, 14]
    args = build_case(rng, q_lens, kv_lens)
    q, k_cache, v_cache, lens, tables, cu, num_seqs = args
    out = np.asarray(ragged_paged_attention(*map(jnp.asarray, args), sm_scale=0.5,
                                            sliding_window=sliding_window, soft_cap=soft_cap))
    want = dense_oracle(q, k_cache, v_cache, kv_lens, tables, q_lens, sm_scale=0.5,
                        sliding_window=sliding_window, soft_cap=soft_cap)
    np.testing.assert_allclose(out[:6], want, rtol=1e-5, atol=1e-5)


def test_bad_shapes_raise_value_error_naming_the_problem():
    rng = np.random.default_rng(0)
    q, k_cache, v_cache, lens, tables, cu, num_seqs = map(jnp.asarray, build_case(rng, [2], [2]))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ragged_paged_attention(q[:, :3], k_cache, v_cache, lens, tables, cu, num_seqs, sm_scale=1.0)
    with pytest.raises(ValueError, match="cu_q_lens"):
        ragged_paged_attention(q, k_cache, v_cache, lens, tables, cu[:-1], num_seqs, sm_scale=1.0)
    with pytest.raises(ValueError, match="backend='cuda'"):
        ragged_paged_attention(q, k_cache, v_cache, lens, tables, cu, num_seqs, sm_scale=1.0,
                               backend="cuda")


def test_kv_cache_update_writes_slots_and_skips_minus_one():
    k_cache = jnp.zeros((3, 2, 1, 2))
    v_cache = jnp.zeros((3, 2, 1, 2))
    k_new = jnp.arange(8, dtype=jnp.float32).reshape(4, 1, 2) + 1
    slots = jnp.array([5, -1, 2, -1], jnp.int32)
    k_out, v_out = kv_cache_update(k_cache, v_cache, k_new, -k_new, slots)
    flat = np.asarray(k_out).reshape(6, 2)
    np.testing.assert_array_equal(flat[5], [1, 2])
    np.testing.assert_array_equal(flat[2], [5, 6])
    assert (np.delete(flat, [2, 5], axis=0) == 0).all()
    np.testing.assert_array_equal(np.asarray(v_out).reshape(6, 2)[5], [-1, -2])
    with pytest.raises(ValueError, match="k_new/v_new"):
        kv_cache_update(k_cache, v_cache, k_new[:, :, :1], k_new, slots)
