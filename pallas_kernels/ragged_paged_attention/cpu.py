"""Ragged paged attention on the CPU: the C++ kernel ``cpu_kernel.cc`` as an XLA FFI call.

Two calls: ``ragged_paged_attention_cpu`` reads one layer's caches; ``write_and_attend_cpu`` takes
every layer's caches, first writes one layer's new keys and values into them, in place
(the caches are aliased from operands to results), and returns them with the attention.

Float32 queries over float32 caches, or over byte caches (int8 / fp8 KV,
``kv_format``, read through a 256-entry table); ``available(dtype)`` says whether it can run here (a compiler was found and
the build worked, see ``pallas_kernels._cpu_build``). Same contract and results as the
reference (up to float rounding), with each sequence reading only its own pages up to
its own length.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _cpu_build
from pallas_kernels.kv_quant import lookup_table
from pallas_kernels.kv_token_scale import table as token_table

_SOURCE = Path(__file__).with_name("cpu_kernel.cc")
_TARGET = "jaxpage_ragged_paged_attention_f32"
_WRITE_TARGET = "jaxpage_write_and_attend_f32"
_BYTES_TARGET = "jaxpage_ragged_paged_attention_bytes"
_WRITE_BYTES_TARGET = "jaxpage_write_and_attend_bytes"
_TOKEN_TARGET = "jaxpage_ragged_paged_attention_token_scaled"
_WRITE_TOKEN_TARGET = "jaxpage_write_and_attend_token_scaled"


def register() -> bool:
    """Build, load and register the kernel with XLA (idempotent). False if unavailable.

    Must run before any compiled program that calls the kernel is loaded from disk.
    """
    return _cpu_build.register(_SOURCE, {
        _TARGET: "JaxpageRaggedPagedAttentionF32", _WRITE_TARGET: "JaxpageWriteAndAttendF32",
        _BYTES_TARGET: "JaxpageRaggedPagedAttentionBytes",
        _WRITE_BYTES_TARGET: "JaxpageWriteAndAttendBytes",
        _TOKEN_TARGET: "JaxpageRaggedPagedAttentionTokenScaled",
        _WRITE_TOKEN_TARGET: "JaxpageWriteAndAttendTokenScaled"})


def available(dtype=jnp.float32) -> bool:
    """Whether the CPU kernel can serve a cache of ``dtype`` in this process."""
    return jnp.dtype(dtype) == jnp.float32 and register()


def ragged_paged_attention_cpu(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens,
                               num_seqs, *, sm_scale: float, sliding_window: int | None = None,
                               soft_cap: float | None = None, kv_format: str | None = None,
                               k_scale=None, v_scale=None, token_scales=None) -> jax.Array:
    """-> [T, Hq, D] float32; the caller has validated shapes (see ``__init__``).

    ``kv_format``: the caches hold bytes of that format (``pallas_kernels.kv_quant``),
    standing for ``k_scale`` / ``v_scale`` [Hkv, D] times their values (None: ones), and
    with ``token_scales`` (codes [N, B, Hkv] each) times each token's scale.
    """
    _require_float32(q, k_cache, kv_format)
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    if token_scales is not None:
        call = jax.ffi.ffi_call(_TOKEN_TARGET, out, vmap_method="sequential")
        k_scale, v_scale = _scales(k_cache, k_scale, v_scale)
        return call(q, k_cache, v_cache, jnp.asarray(lookup_table(kv_format)), k_scale,
                    v_scale, *token_scales, jnp.asarray(token_table()), i32(kv_lens),
                    i32(block_tables), i32(cu_q_lens), i32(num_seqs),
                    sm_scale=np.float32(sm_scale), sliding_window=np.int32(sliding_window or 0),
                    soft_cap=np.float32(soft_cap or 0.0))
    if kv_format is not None:
        call = jax.ffi.ffi_call(_BYTES_TARGET, out, vmap_method="sequential")
        k_scale, v_scale = _scales(k_cache, k_scale, v_scale)
        return call(q, k_cache, v_cache, jnp.asarray(lookup_table(kv_format)), k_scale,
                    v_scale, i32(kv_lens),
                    i32(block_tables), i32(cu_q_lens), i32(num_seqs),
                    sm_scale=np.float32(sm_scale), sliding_window=np.int32(sliding_window or 0),
                    soft_cap=np.float32(soft_cap or 0.0))
    call = jax.ffi.ffi_call(_TARGET, out, vmap_method="sequential")
    return call(q, k_cache, v_cache, i32(kv_lens), i32(block_tables), i32(cu_q_lens),
                i32(num_seqs), sm_scale=np.float32(sm_scale),
                sliding_window=np.int32(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0))


def write_and_attend_cpu(q, k_new, v_new, slot_mapping, k_cache, v_cache, kv_lens,
                         block_tables, cu_q_lens, num_seqs, *, layer: int, sm_scale: float,
                         sliding_window: int | None = None, soft_cap: float | None = None,
                         kv_format: str | None = None, k_scale=None, v_scale=None,
                         new_token_scales=None, token_scales=None):
    """Write ``k_new`` / ``v_new`` [T, Hkv, D] into slots ``slot_mapping`` [T] (-1: skip)
    of layer ``layer`` of the caches [L, N, B, Hkv, D], then attend over that layer as
    ``ragged_paged_attention_cpu`` (slots and block tables address the layer's pages).

    -> (out [T, Hq, D], k_cache, v_cache): the caches come back in the buffers they came
    in (``input_output_aliases``), so under ``jit`` with a donated cache nothing is copied.
    With ``kv_format`` the caches are bytes and ``k_new`` / ``v_new`` come encoded, as
    ``ragged_paged_attention_cpu`` (``k_scale`` / ``v_scale``: this layer's [Hkv, D]).
    With ``token_scales`` (every layer's codes [L, N, B, Hkv], keys and values) the new
    tokens' codes ``new_token_scales`` ([T, Hkv] each) are written too, and the codes
    come back after the caches: (out, k_cache, v_cache, (k_codes, v_codes)).
    """
    _require_float32(q, k_cache, kv_format)
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    if token_scales is not None:
        u8 = jnp.uint8
        call = jax.ffi.ffi_call(
            _WRITE_TOKEN_TARGET,
            (jax.ShapeDtypeStruct(q.shape, jnp.float32),
             jax.ShapeDtypeStruct(k_cache.shape, u8), jax.ShapeDtypeStruct(v_cache.shape, u8),
             jax.ShapeDtypeStruct(token_scales[0].shape, u8),
             jax.ShapeDtypeStruct(token_scales[1].shape, u8)),
            input_output_aliases={4: 1, 5: 2, 11: 3, 12: 4}, vmap_method="sequential")
        k_scale, v_scale = _scales(k_cache, k_scale, v_scale)
        out, k_cache, v_cache, k_codes, v_codes = call(
            q, k_new, v_new, i32(slot_mapping), k_cache, v_cache,
            jnp.asarray(lookup_table(kv_format)), k_scale, v_scale, *new_token_scales,
            *token_scales, jnp.asarray(token_table()), i32(kv_lens), i32(block_tables),
            i32(cu_q_lens), i32(num_seqs), layer=np.int32(layer),
            sm_scale=np.float32(sm_scale), sliding_window=np.int32(sliding_window or 0),
            soft_cap=np.float32(soft_cap or 0.0))
        return out, k_cache, v_cache, (k_codes, v_codes)
    if kv_format is not None:
        u8 = jnp.uint8
        call = jax.ffi.ffi_call(
            _WRITE_BYTES_TARGET,
            (jax.ShapeDtypeStruct(q.shape, jnp.float32),
             jax.ShapeDtypeStruct(k_cache.shape, u8), jax.ShapeDtypeStruct(v_cache.shape, u8)),
            input_output_aliases={4: 1, 5: 2}, vmap_method="sequential")
        k_scale, v_scale = _scales(k_cache, k_scale, v_scale)
        return call(q, k_new, v_new, i32(slot_mapping), k_cache, v_cache,
                    jnp.asarray(lookup_table(kv_format)), k_scale, v_scale, i32(kv_lens),
                    i32(block_tables),
                    i32(cu_q_lens), i32(num_seqs), layer=np.int32(layer),
                    sm_scale=np.float32(sm_scale), sliding_window=np.int32(sliding_window or 0),
                    soft_cap=np.float32(soft_cap or 0.0))
    call = jax.ffi.ffi_call(
        _WRITE_TARGET,
        (jax.ShapeDtypeStruct(q.shape, jnp.float32),
         jax.ShapeDtypeStruct(k_cache.shape, jnp.float32),
         jax.ShapeDtypeStruct(v_cache.shape, jnp.float32)),
        input_output_aliases={4: 1, 5: 2}, vmap_method="sequential")
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return call(q, f32(k_new), f32(v_new), i32(slot_mapping), k_cache, v_cache, i32(kv_lens),
                i32(block_tables), i32(cu_q_lens), i32(num_seqs), layer=np.int32(layer),
                sm_scale=np.float32(sm_scale), sliding_window=np.int32(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0))


def _scales(k_cache, k_scale, v_scale):
    """float32 [Hkv, D] key and value scales (ones where None)."""
    ones = jnp.ones(k_cache.shape[-2:], jnp.float32)
    return (ones if k_scale is None else jnp.asarray(k_scale, jnp.float32),
            ones if v_scale is None else jnp.asarray(v_scale, jnp.float32))


def _require_float32(q, k_cache, kv_format: str | None = None) -> None:
    cache_dtype = jnp.uint8 if kv_format is not None else jnp.float32
    if not available(q.dtype) or k_cache.dtype != cache_dtype:
        raise ValueError(f"the CPU attention kernel needs float32 q and caches, got "
                         f"{q.dtype} and {k_cache.dtype} (or no C++ compiler was found)")
