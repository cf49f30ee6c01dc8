"""Dense float32 matmuls on the CPU: the C++ kernel ``cpu_kernel.cc`` as an XLA FFI call.

``available()`` says whether it could be built here (``pallas_kernels._cpu_build``). Same
products as ``jnp.dot`` at float32 precision up to rounding (each output is one FMA chain
over K in order, independent of the number of rows).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels import _cpu_build

_SOURCE = Path(__file__).with_name("cpu_kernel.cc")
_TARGET = "jaxpage_dense_matmul_f32"


def register() -> bool:
    """Build, load and register the kernel with XLA (idempotent). False if unavailable.

    Must run before any compiled program that calls it is loaded from disk.
    """
    return _cpu_build.register(_SOURCE, {_TARGET: "JaxpageDenseMatmulF32"})


def available() -> bool:
    return register()


def live_rows_operand(rows: jax.Array | int | None, m: int) -> jax.Array:
    """The kernels' ``rows`` operand, int32 [1]: the rows to compute (None: all m)."""
    value = m if rows is None else rows
    return jnp.reshape(jnp.asarray(value, jnp.int32), (1,))


def dense_matmul_cpu(x: jax.Array, w: jax.Array, rows: jax.Array | int | None = None) -> jax.Array:
    """x float32 [M, K] @ w float32 [K, N] -> float32 [M, N]; with ``rows`` (an int32
    scalar) only the first ``rows`` rows are computed, the others are zeros."""
    if not register():
        raise RuntimeError("the C++ dense-matmul kernel is not available here")
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32),
                            vmap_method="sequential")
    return call(x, w, live_rows_operand(rows, x.shape[0]))
