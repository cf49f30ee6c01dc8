"""``sample_rows`` on the CPU: the C++ kernel ``cpu_kernel.cc`` as an XLA FFI call.

``available()`` says whether it could be built here (``pallas_kernels._cpu_build``). Same
tokens as ``reference.sample_rows`` except where two candidates' noisy scores lie within
the logarithms' last-bit difference of each other.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels import _cpu_build

_SOURCE = Path(__file__).with_name("cpu_kernel.cc")
_TARGET = "jaxpage_sample_rows"


def register() -> bool:
    """Build, load and register the kernel with XLA (idempotent). False if unavailable.

    Must run before any compiled program that calls it is loaded from disk.
    """
    return _cpu_build.register(_SOURCE, {_TARGET: "JaxpageSampleRows"})


def available() -> bool:
    return register()


def sample_rows_cpu(logits: jax.Array, temperature: jax.Array, threshold: jax.Array,
                    min_p: jax.Array, seeds: jax.Array, index: jax.Array) -> jax.Array:
    """-> int32 [S]; see ``reference.sample_rows``."""
    if not register():
        raise RuntimeError("the C++ sampling kernel is not available here")
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((logits.shape[0],), jnp.int32),
                            vmap_method="sequential")
    return call(f32(logits), f32(temperature), f32(threshold), f32(min_p),
                jnp.asarray(seeds).astype(jnp.uint32), jnp.asarray(index).astype(jnp.int32))
