"""Ragged paged attention on the CPU: the C++ kernel ``cpu_kernel.cc`` as an XLA FFI call.

Float32 only; ``available(dtype)`` says whether it can run here (a compiler was found and
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

_SOURCE = Path(__file__).with_name("cpu_kernel.cc")
_TARGET = "jaxpage_ragged_paged_attention_f32"
_registered = False


def register() -> bool:
    """Build, load and register the kernel with XLA (idempotent). False if unavailable.

    Must run before any compiled program that calls the kernel is loaded from disk.
    """
    global _registered
    if _registered:
        return True
    library = _cpu_build.load(_SOURCE)
    if library is None:
        return False
    jax.ffi.register_ffi_target(
        _TARGET, jax.ffi.pycapsule(library.JaxpageRaggedPagedAttentionF32), platform="cpu")
    _registered = True
    return True


def available(dtype=jnp.float32) -> bool:
    """Whether the CPU kernel can serve a cache of ``dtype`` in this process."""
    return jnp.dtype(dtype) == jnp.float32 and register()


def ragged_paged_attention_cpu(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens,
                               num_seqs, *, sm_scale: float, sliding_window: int | None = None,
                               soft_cap: float | None = None) -> jax.Array:
    """-> [T, Hq, D] float32; the caller has validated shapes (see ``__init__``)."""
    if not available(q.dtype) or k_cache.dtype != jnp.float32:
        raise ValueError(f"the CPU attention kernel needs float32 q and caches, got "
                         f"{q.dtype} and {k_cache.dtype} (or no C++ compiler was found)")
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return call(q, k_cache, v_cache, i32(kv_lens), i32(block_tables), i32(cu_q_lens),
                i32(num_seqs), sm_scale=np.float32(sm_scale),
                sliding_window=np.int32(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0))
