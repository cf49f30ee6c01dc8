"""Public ragged paged attention: validates shapes, then dispatches to a backend.

New tokens of sequence ``i`` are the last ``cu_q_lens[i+1] - cu_q_lens[i]`` positions of
its ``kv_lens[i]`` cached tokens and attend causally. Rows of padding tokens are zero.
"""

from __future__ import annotations

import jax

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

BACKENDS = ("auto", "reference", "gpu", "tpu")


def resolve_backend(backend: str) -> str:
    """The concrete backend for ``backend`` on this platform."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        return "reference"  # the Pallas GPU/TPU kernels are selected here once they land
    if backend in ("gpu", "tpu"):
        raise ValueError(f"backend={backend!r}: the Pallas {backend} kernel is not available "
                         "in this version; use 'reference' or 'auto'")
    return backend


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def ragged_paged_attention(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, *,
                           sm_scale: float, sliding_window: int | None = None,
                           soft_cap: float | None = None, backend: str = "auto",
                           interpret: bool = False) -> jax.Array:
    """Attention of concatenated ragged queries over a paged KV cache -> [T, Hq, D]."""
    _check(q.ndim == 3, f"q must be [num_tokens, num_q_heads, head_dim], got shape {q.shape}")
    _check(k_cache.ndim == 4 and k_cache.shape == v_cache.shape,
           f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
           f"got {k_cache.shape} and {v_cache.shape}")
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    _check(q.shape[2] == head_dim, f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    _check(q.shape[1] % num_kv_heads == 0,
           f"num_q_heads={q.shape[1]} is not a multiple of num_kv_heads={num_kv_heads}")
    _check(block_tables.ndim == 2, f"block_tables must be 2-D, got shape {block_tables.shape}")
    max_num_seqs = block_tables.shape[0]
    _check(kv_lens.shape == (max_num_seqs,),
           f"kv_lens shape {kv_lens.shape} != (max_num_seqs={max_num_seqs},)")
    _check(cu_q_lens.shape == (max_num_seqs + 1,),
           f"cu_q_lens shape {cu_q_lens.shape} != (max_num_seqs + 1 = {max_num_seqs + 1},)")
    _check(num_seqs.shape == (1,), f"num_seqs must have shape (1,), got {num_seqs.shape}")
    _check(sliding_window is None or sliding_window >= 1,
           f"sliding_window={sliding_window!r} must be None or >= 1")
    _check(soft_cap is None or soft_cap > 0, f"soft_cap={soft_cap!r} must be None or > 0")
    resolve_backend(backend)
    return ragged_paged_attention_reference(
        q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)


__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference", "resolve_backend"]
