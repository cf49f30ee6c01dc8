"""Quantized matmuls on the CPU: the C++ kernels of ``cpu_kernel.cc`` as XLA FFI calls.

Float32 activations only; ``available()`` says whether the kernels could be built here
(``pallas_kernels._cpu_build``). Same results as ``reference.py`` up to float rounding
(the sum runs group by group, scaled per group).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels import _cpu_build

_SOURCE = Path(__file__).with_name("cpu_kernel.cc")
_TARGETS = {"matmul_s8": "jaxpage_qmatmul_s8", "matmul_u4": "jaxpage_qmatmul_u4",
            "dequant_s8": "jaxpage_dequant_s8", "dequant_u4": "jaxpage_dequant_u4"}
_SYMBOLS = {"jaxpage_qmatmul_s8": "JaxpageQMatmulS8", "jaxpage_qmatmul_u4": "JaxpageQMatmulU4",
            "jaxpage_dequant_s8": "JaxpageDequantS8", "jaxpage_dequant_u4": "JaxpageDequantU4"}


def register() -> bool:
    """Build, load and register the kernels with XLA (idempotent). False if unavailable.

    Must run before any compiled program that calls them is loaded from disk.
    """
    return _cpu_build.register(_SOURCE, _SYMBOLS)


def available() -> bool:
    return register()


def _operands(weight: dict[str, jax.Array]) -> tuple[str, list[jax.Array], int]:
    if not register():
        raise RuntimeError("the C++ quantized-matmul kernels are not available here")
    four = "zero" in weight
    codes = weight["codes"]
    operands = [codes, weight["scale"].astype(jnp.float32)]
    if four:
        operands.append(weight["zero"].astype(jnp.float32))
    k = codes.shape[0] * (2 if four else 1)
    return ("u4" if four else "s8"), operands, k


def quantized_matmul_cpu(x: jax.Array, weight: dict[str, jax.Array]) -> jax.Array:
    """x float32 [M, K] @ W -> float32 [M, N], the codes read in place (decode sizes)."""
    kind, operands, _ = _operands(weight)
    n = weight["codes"].shape[1]
    call = jax.ffi.ffi_call(_TARGETS[f"matmul_{kind}"],
                            jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    return call(x.astype(jnp.float32), *operands)


def dequantize_cpu(weight: dict[str, jax.Array]) -> jax.Array:
    """W as float32 [K, N]."""
    kind, operands, k = _operands(weight)
    n = weight["codes"].shape[1]
    call = jax.ffi.ffi_call(_TARGETS[f"dequant_{kind}"],
                            jax.ShapeDtypeStruct((k, n), jnp.float32), vmap_method="sequential")
    return call(*operands)
