"""One layer's paged-cache step: write the new keys and values, then attend.

This is the call the model makes once per layer, on the caches of all layers
``[L, N, B, Hkv, D]``: ``slot_mapping`` and ``block_tables`` address layer ``layer``'s
pages as if it were the only one.

Where the attention backend resolves to the C++ CPU kernel, both halves run in one FFI
call that updates the caches in place (``ragged_paged_attention.cpu.write_and_attend_cpu``).
Everywhere else it is ``kv_cache_update`` followed by ``ragged_paged_attention``, each
with its own backend rule, both given the whole caches and ``layer``: they index the
layer's pages in place. (An earlier version viewed the caches as one page pool
``[L * N, B, Hkv, D]``; free on the CPU and GPUs, that reshape made XLA:TPU copy the whole
cache in and out of every layer's call whenever its tiled layout of the cache differed
from the kernel's, as ``jaxpage plan`` showed: Llama-3-8B at TP=8 on v5e needed 25.9 GB.)

Why one call on the CPU: with the layers unrolled, XLA's copy insertion copied the whole
cache (twice per layer, per step) around a separate scatter feeding the attention in some
decode loops (one token per step, where the scatter becomes a dynamic-update-slice), and
around the reshapes to and from the page pool. A single custom call that reads and writes
the caches as they are, with results aliased to operands, leaves nothing to copy.
"""

from __future__ import annotations

import jax

from pallas_kernels import _backend
from pallas_kernels.kv_cache_update import check_shapes as check_update
from pallas_kernels.kv_cache_update import kv_cache_update, token_scales_update
from pallas_kernels.ragged_paged_attention import check_kv_format, check_token_scales
from pallas_kernels.ragged_paged_attention import check_shapes as check_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, resolve_backend


def write_and_attend(q, k_new, v_new, slot_mapping, k_cache, v_cache, kv_lens, block_tables,
                     cu_q_lens, num_seqs, *, layer: int, sm_scale: float,
                     sliding_window: int | None = None, soft_cap: float | None = None,
                     backend: str = "auto", interpret: bool = False,
                     kv_format: str | None = None, k_scale: jax.Array | None = None,
                     v_scale: jax.Array | None = None,
                     new_token_scales: tuple[jax.Array, jax.Array] | None = None,
                     token_scales: tuple[jax.Array, jax.Array] | None = None) -> tuple:
    """Write ``k_new`` / ``v_new`` [T, Hkv, D] into layer ``layer``'s slots
    ``slot_mapping`` [T] (-1: skip) of ``k_cache`` / ``v_cache`` [L, N, B, Hkv, D], then
    attend ``q`` [T, Hq, D] over that layer's updated pages. With ``v_cache`` None,
    ``k_cache`` is a fused cache ``[L, N, B, W]`` (``kv_layout``) and None comes back in
    ``v_cache``'s place.

    -> (attention [T, Hq, D], k_cache, v_cache). ``backend`` picks the attention kernel
    (``ragged_paged_attention``'s rule); the same checks and errors apply. With
    ``kv_format`` the caches are bytes (``kv_quant``) and ``k_new`` / ``v_new`` come
    already encoded (``k / k_scale``, ``v / v_scale``, scales [Hkv, D] of this layer).
    With ``token_scales`` (every layer's per-token scale codes [L, N, B, Hkv], keys and
    values; ``kv_token_scale``) the new tokens' codes ``new_token_scales`` ([T, Hkv] each,
    what ``k_new`` / ``v_new`` were divided by) are written too and the codes come back
    fourth: (attention, k_cache, v_cache, (k_codes, v_codes)).
    """
    if v_cache is not None and (k_cache.ndim != 5 or k_cache.shape != v_cache.shape):
        raise ValueError(f"k_cache and v_cache must both be [num_layers, num_blocks, "
                         f"block_size, num_kv_heads, head_dim], got {k_cache.shape} and "
                         f"{v_cache.shape}")
    # one layer's pages as split shapes, for the checks
    layer_view = _backend.layer_view(k_cache, v_cache, layer, head_dim=q.shape[-1])
    check_update(layer_view, layer_view, k_new, v_new, slot_mapping)
    check_attention(q, layer_view, layer_view, kv_lens, block_tables, cu_q_lens, num_seqs,
                    sliding_window=sliding_window, soft_cap=soft_cap)
    check_kv_format(k_cache, v_cache, kv_format)
    check_token_scales(k_cache, v_cache, kv_format, token_scales)
    if (token_scales is None) != (new_token_scales is None):
        raise ValueError("token_scales and new_token_scales go together (per-token scale "
                         "codes of the caches and of the new tokens)")
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if kv_format is not None:
        kwargs["kv_format"] = kv_format
    v_dtype = k_cache.dtype if v_cache is None else v_cache.dtype
    same_dtype = (q.dtype == k_cache.dtype == v_dtype if kv_format is None
                  else k_new.dtype == v_new.dtype == k_cache.dtype)
    if (q.shape[0] > 0 and same_dtype and v_cache is not None
            and resolve_backend(backend, interpret=interpret, dtype=q.dtype) == "cpu"):
        from pallas_kernels.ragged_paged_attention.cpu import write_and_attend_cpu
        if kv_format is not None:
            kwargs.update(k_scale=k_scale, v_scale=v_scale)
        if token_scales is not None:
            kwargs.update(new_token_scales=tuple(new_token_scales),
                          token_scales=tuple(token_scales))
        return write_and_attend_cpu(q, k_new, v_new, slot_mapping, k_cache, v_cache, kv_lens,
                                    block_tables, cu_q_lens, num_seqs, layer=layer, **kwargs)
    k_cache, v_cache = kv_cache_update(k_cache, v_cache, k_new, v_new, slot_mapping,
                                       layer=layer)
    if kv_format is not None:
        kwargs.update(k_scale=k_scale, v_scale=v_scale)
    if token_scales is not None:
        token_scales = token_scales_update(token_scales, new_token_scales, slot_mapping,
                                           layer=layer)
        kwargs["token_scales"] = token_scales
    out = ragged_paged_attention(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens,
                                 num_seqs, backend=backend, interpret=interpret, layer=layer,
                                 **kwargs)
    return (out, k_cache, v_cache) + ((token_scales,) if token_scales is not None else ())
