"""Quantized matmuls on the CPU: the C++ kernels of ``cpu_kernel.cc`` as XLA FFI calls.

Float32 activations only; ``available()`` says whether the kernels could be built here
(``pallas_kernels._cpu_build``). Each weight is converted as ``reference.dequantize`` does
(exactly so for GGUF's blocks) and the sums are ``dense_matmul``'s on those floats, bit
for bit.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels import _cpu_build
from pallas_kernels.dense_matmul.cpu import live_rows_operand

_SOURCE = Path(__file__).with_name("cpu_kernel.cc")
_TARGETS = {"s8": "jaxpage_qmatmul_s8", "s8z": "jaxpage_qmatmul_s8z", "u4": "jaxpage_qmatmul_u4"}
_SYMBOLS = {"jaxpage_qmatmul_s8": "JaxpageQMatmulS8", "jaxpage_qmatmul_s8z": "JaxpageQMatmulS8Z",
            "jaxpage_qmatmul_u4": "JaxpageQMatmulU4"}


def register() -> bool:
    """Build, load and register the kernels with XLA (idempotent). False if unavailable.

    Must run before any compiled program that calls them is loaded from disk.
    """
    return _cpu_build.register(_SOURCE, _SYMBOLS)


def available() -> bool:
    return register()


def quantized_matmul_cpu(x: jax.Array, weight: dict[str, jax.Array],
                         rows: jax.Array | int | None = None) -> jax.Array:
    """x float32 [M, K] @ W -> float32 [M, N]: the sums of ``dense_matmul`` on W's floats;
    with ``rows`` (an int32 scalar) only the first ``rows`` rows, the others zeros."""
    if not register():
        raise RuntimeError("the C++ quantized-matmul kernels are not available here")
    codes = weight["codes"]  # plain [R, N] or packed by panels [N / 64, R, 64]
    if codes.dtype == jnp.uint8:  # 4-bit, always with a zero
        target = "u4"
    elif codes.dtype == jnp.int8:
        target = "s8z" if "zero" in weight else "s8"
    else:
        raise ValueError(f"the C++ quantized-matmul kernels read int8 or uint8 codes, got "
                         f"{codes.dtype}")
    n = codes.shape[0] * codes.shape[2] if codes.ndim == 3 else codes.shape[1]
    operands = [codes, weight["scale"].astype(jnp.float32)]
    if target != "s8":
        operands.append(weight["zero"].astype(jnp.float32))
    call = jax.ffi.ffi_call(_TARGETS[target],
                            jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    return call(x.astype(jnp.float32), *operands, live_rows_operand(rows, x.shape[0]))
