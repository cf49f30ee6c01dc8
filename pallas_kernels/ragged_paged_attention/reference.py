"""Plain-jnp ragged paged attention: the ground truth every kernel is tested against.

Each token gathers the K/V pages of its own sequence through the block table and
attends causally to the first ``q_pos + 1`` of them. Simple and exact; not tuned.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import kv_layout, kv_token_scale
from pallas_kernels._backend import searchsorted_right
from pallas_kernels.kv_quant import decode
from pallas_kernels.kv_token_scale import embedded_codes, token_scale_values
from pallas_kernels.precision import dot_precision


def token_layout(cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array,
                 num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per token: its sequence index, its absolute position, and whether it is real.

    Returns ``seq`` int32 [T] (clamped into range for padding tokens), ``q_pos`` int32 [T]
    and ``valid`` bool [T].
    """
    max_num_seqs = kv_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = searchsorted_right(cu_q_lens[1:], t).astype(jnp.int32)
    valid = t < cu_q_lens[num_seqs[0]]
    seq = jnp.minimum(seq, max_num_seqs - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    q_pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])
    return seq, q_pos, valid


def ragged_paged_attention_reference(
        q: jax.Array,             # [T, Hq, D]
        k_cache: jax.Array,       # [N, B, Hkv, D], or [L, N, B, Hkv, D] with ``layer``
        v_cache: jax.Array | None,  # likewise; None: k_cache is fused rows [(L,) N, B, W]
        kv_lens: jax.Array,       # int32 [S]
        block_tables: jax.Array,  # int32 [S, M]
        cu_q_lens: jax.Array,     # int32 [S + 1]
        num_seqs: jax.Array,      # int32 [1]
        *, sm_scale: float, sliding_window: int | None = None,
        soft_cap: float | None = None, layer: int | None = None,
        kv_format: str | None = None,
        token_scales: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:  # [T, Hq, D]
    """With ``layer``, the caches hold every layer and layer ``layer``'s pages are read.
    With ``kv_format`` the caches hold bytes of that format (``kv_quant.decode``), and
    with ``token_scales`` (key and value scale codes, uint8 [(L,) N, B, Hkv]) each
    token's bytes stand for their values divided by its scale (``kv_token_scale``).
    With ``v_cache`` None the cache is in the fused layout (``kv_layout``); an int8 one
    carries each token's scale codes in its value bytes (``kv_token_scale.embedded``)."""
    num_tokens, num_q_heads, head_dim = q.shape
    fused = v_cache is None
    block_size = k_cache.shape[-2] if fused else k_cache.shape[-3]
    num_kv_heads = (kv_layout.heads_in_row(k_cache.shape[-1], head_dim) if fused
                    else k_cache.shape[-2])
    max_blocks = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    seq, q_pos, valid = token_layout(cu_q_lens, kv_lens, num_seqs, num_tokens)

    tables = block_tables[seq]                                          # [T, M]
    span = max_blocks * block_size
    pages = tables if layer is None else (layer, tables)
    if fused:
        k, v = kv_layout.unfuse(k_cache[pages], head_dim)               # [T, M, B, Hkv, D]
    else:
        k, v = k_cache[pages], v_cache[pages]
    k = k.reshape(num_tokens, span, num_kv_heads, head_dim)             # [T, L, Hkv, D]
    v = v.reshape(num_tokens, span, num_kv_heads, head_dim)
    codes = None  # each token's key and value scale codes [T, L, Hkv], if it has them
    if fused and kv_token_scale.embedded(kv_format, kv_layout.FUSED):  # in its value bytes
        codes = embedded_codes(v)
    elif token_scales is not None:
        codes = tuple(c[pages].reshape(num_tokens, span, num_kv_heads) for c in token_scales)
    if kv_format is not None:
        k, v = decode(k, kv_format, q.dtype), decode(v, kv_format, q.dtype)
    if codes is not None:
        k = k * token_scale_values(codes[0], q.dtype)[..., None]
        v = v * token_scale_values(codes[1], q.dtype)[..., None]
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)           # [T, Hkv, G, D]
    scores = jnp.einsum("tkgd,tlkd->tkgl", qg, k, precision=dot_precision(q.dtype),
                        preferred_element_type=jnp.float32) * sm_scale  # [T, Hkv, G, L]
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    kv_pos = jnp.arange(span, dtype=jnp.int32)
    mask = (kv_pos[None, :] <= q_pos[:, None]) & valid[:, None]         # [T, L]
    if sliding_window is not None:
        mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.exp(scores - row_max)
    denom = jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), 1e-30)
    out = jnp.einsum("tkgl,tlkd->tkgd", (probs / denom).astype(v.dtype), v,
                     precision=dot_precision(v.dtype), preferred_element_type=jnp.float32)
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
