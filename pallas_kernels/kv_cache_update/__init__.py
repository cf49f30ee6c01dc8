"""Public KV cache update: validates shapes, then scatters (slot -1 is skipped).

Backends: ``"reference"`` (an XLA scatter), ``"gpu"`` (Pallas Triton) and ``"tpu"``
(Pallas Mosaic TPU, DMA per token). ``"auto"`` picks the reference on every platform:
XLA's scatter is already one in-place kernel when the cache is donated, nothing measured
yet says the Pallas versions beat it, and the engine has no option to switch this call
back if a compiled Pallas version misbehaves. Ask for ``"gpu"`` / ``"tpu"`` explicitly
(with ``interpret=True`` on the CPU) to run the Pallas versions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _backend
from pallas_kernels.kv_cache_update.reference import kv_cache_update_reference, scatter_slots


def resolve_backend(backend: str, *, interpret: bool = False) -> str:
    """The concrete backend for ``backend`` on this platform ("auto" -> "reference")."""
    return _backend.resolve(backend, interpret=interpret, auto="reference")


def check_shapes(k_cache, v_cache, k_new, v_new, slot_mapping) -> None:
    """Raise ``ValueError`` naming the offending shape."""
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, "
                         f"num_kv_heads, head_dim], got {k_cache.shape} and {v_cache.shape}")
    if slot_mapping.ndim != 1:
        raise ValueError(f"slot_mapping must be 1-D, got shape {slot_mapping.shape}")
    expected = (slot_mapping.shape[0],) + k_cache.shape[2:]
    if k_new.shape != expected or v_new.shape != expected:
        raise ValueError(f"k_new/v_new must be {expected} (num_tokens, num_kv_heads, head_dim), "
                         f"got {k_new.shape} and {v_new.shape}")


def kv_cache_update(k_cache, v_cache, k_new, v_new, slot_mapping, *, backend: str = "auto",
                    interpret: bool = False, layer: int | None = None
                    ) -> tuple[jax.Array, jax.Array | None]:
    """Write ``k_new[t]`` / ``v_new[t]`` into flat slot ``slot_mapping[t]`` (-1: skip).

    With ``layer`` the caches are every layer's, ``[L, N, B, Hkv, D]``, and the slots
    are layer ``layer``'s; the cache is updated where it is, never reshaped. With
    ``v_cache`` None, ``k_cache`` is a fused cache (``kv_layout``) and None comes back
    in ``v_cache``'s place; the reference and the TPU kernel write it (the GPU kernel
    writes split caches only, and falls back to the reference).
    """
    view = _backend.layer_view(k_cache, v_cache, layer, head_dim=k_new.shape[-1])
    check_shapes(view, view, k_new, v_new, slot_mapping)
    resolved = resolve_backend(backend, interpret=interpret)
    args = (k_cache, v_cache, k_new, v_new, slot_mapping)
    if (resolved in ("reference", "cpu") or slot_mapping.shape[0] == 0  # no C++ version:
            or (resolved == "gpu" and v_cache is None)):  # XLA's scatter is one in-place pass
        return kv_cache_update_reference(*args, layer=layer)
    if resolved == "gpu":
        from pallas_kernels.kv_cache_update.gpu import kv_cache_update_gpu
        return kv_cache_update_gpu(*args, interpret=interpret, layer=layer)
    from pallas_kernels.kv_cache_update import tpu
    if v_cache is None:
        return tpu.kv_cache_update_fused_tpu(*args, interpret=interpret, layer=layer)
    return tpu.kv_cache_update_tpu(*args, interpret=interpret, layer=layer)


def token_scales_update(token_scales: tuple, new_token_scales: tuple, slot_mapping,
                        layer: int | None = None) -> tuple:
    """Per-token scale codes (``kv_token_scale``): ``token_scales`` ([(L,) N, B, Hkv]
    uint8, keys and values) with ``new_token_scales`` ([T, Hkv] each) written into slots
    ``slot_mapping`` (-1: skip). An XLA scatter on every platform: a byte per token and
    head."""
    expected = (slot_mapping.shape[0], token_scales[0].shape[-1])
    if any(new.shape != expected or new.dtype != jnp.uint8 for new in new_token_scales):
        raise ValueError(f"new token scale codes must be uint8 {expected}, got "
                         f"{[(new.shape, str(new.dtype)) for new in new_token_scales]}")
    num_blocks, block_size = token_scales[0].shape[-3:-1]
    return scatter_slots(tuple(token_scales), tuple(new_token_scales), slot_mapping,
                         num_blocks, block_size, layer)


__all__ = ["check_shapes", "token_scales_update", "kv_cache_update", "kv_cache_update_reference", "resolve_backend"]
