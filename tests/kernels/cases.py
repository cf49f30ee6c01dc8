"""Random ragged paged-attention batches for kernel-vs-reference tests.

A case is a real batch (``q_lens`` new tokens on top of ``kv_lens`` cached tokens per
sequence) laid out the way the engine lays it out: permuted physical blocks, block 0
never used (the engine's null block), padding token rows after the real ones and padding
sequence slots after ``num_seqs``. Two copies of the cache come back: ``clean`` (every
slot that no sequence owns is zero) for the reference, and ``poisoned`` (those slots are
NaN) for the kernels, so a kernel that reads past a sequence's end, or through a junk
block-table entry, cannot pass. Padding token rows of q are NaN in both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import jax.numpy as jnp


@dataclass
class Case:
    q: np.ndarray              # [T, Hq, D]
    k_clean: np.ndarray        # [N, B, Hkv, D]
    v_clean: np.ndarray
    k_poisoned: np.ndarray
    v_poisoned: np.ndarray
    kv_lens: np.ndarray        # int32 [S]
    block_tables: np.ndarray   # int32 [S, M]
    cu_q_lens: np.ndarray      # int32 [S + 1]
    num_seqs: np.ndarray       # int32 [1]
    num_real_tokens: int

    def args(self, poisoned: bool) -> tuple:
        k, v = (self.k_poisoned, self.v_poisoned) if poisoned else (self.k_clean, self.v_clean)
        return tuple(map(jnp.asarray, (self.q, k, v, self.kv_lens, self.block_tables,
                                       self.cu_q_lens, self.num_seqs)))


def make_case(rng: np.random.Generator, q_lens, kv_lens, *, num_q_heads=4, num_kv_heads=2,
              head_dim=64, block_size=4, dtype=np.float32, pad_seqs=1, pad_tokens=3,
              extra_blocks=3, junk_tables=True) -> Case:
    q_lens, kv_lens = list(q_lens), list(kv_lens)
    assert all(0 <= q <= k for q, k in zip(q_lens, kv_lens))
    num_seqs, max_num_seqs = len(q_lens), len(q_lens) + pad_seqs
    blocks_needed = [-(-k // block_size) for k in kv_lens]
    max_blocks = max(blocks_needed + [1]) + 1
    num_blocks = 1 + sum(blocks_needed) + extra_blocks
    free = list(rng.permutation(np.arange(1, num_blocks)))
    # Table slots past a sequence's end hold junk (the engine leaves them stale).
    tables = (rng.integers(0, num_blocks, (max_num_seqs, max_blocks)) if junk_tables
              else np.zeros((max_num_seqs, max_blocks), np.int64)).astype(np.int32)
    owned = np.zeros((num_blocks, block_size), bool)
    for i, kv_len in enumerate(kv_lens):
        for j in range(blocks_needed[i]):
            tables[i, j] = block = free.pop()
            owned[block, :min(block_size, kv_len - j * block_size)] = True

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    k_clean = np.where(owned[:, :, None, None], k, 0).astype(dtype)
    v_clean = np.where(owned[:, :, None, None], v, 0).astype(dtype)
    k_poisoned = np.where(owned[:, :, None, None], k, np.nan).astype(dtype)
    v_poisoned = np.where(owned[:, :, None, None], v, np.nan).astype(dtype)

    num_real = sum(q_lens)
    q = rng.standard_normal((num_real + pad_tokens, num_q_heads, head_dim)).astype(np.float32)
    q[num_real:] = np.nan
    cu = np.full(max_num_seqs + 1, num_real, np.int32)
    cu[:num_seqs + 1] = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    lens = np.zeros(max_num_seqs, np.int32)
    lens[:num_seqs] = kv_lens
    return Case(q=q.astype(dtype), k_clean=k_clean, v_clean=v_clean, k_poisoned=k_poisoned,
                v_poisoned=v_poisoned, kv_lens=lens, block_tables=tables, cu_q_lens=cu,
                num_seqs=np.array([num_seqs], np.int32), num_real_tokens=num_real)


def tolerance(dtype) -> dict:
    """assert_allclose tolerances for kernel vs reference at ``dtype``."""
    if np.dtype(dtype) == np.float32:
        return dict(rtol=2e-5, atol=2e-5)
    return dict(rtol=2e-2, atol=2e-2)  # bfloat16: 8 mantissa bits, probabilities rounded


def random_lens(rng: np.random.Generator, kind: str, num_seqs: int, max_kv: int,
                block_size: int) -> tuple[list[int], list[int]]:
    """(q_lens, kv_lens) for a batch of ``kind``: decode, prefill, mixed or boundary."""
    kv = [int(x) for x in rng.integers(1, max_kv + 1, num_seqs)]
    if kind == "boundary":
        kv = [max(1, x // block_size) * block_size for x in kv]
    if kind in ("decode", "boundary"):
        q = [1] * num_seqs
    elif kind == "prefill":
        q = list(kv)
    else:
        q = [int(rng.integers(0, k + 1)) if rng.random() < 0.6 else 1 for k in kv]
    return q, kv
