"""``x [..., K] @ w [K, N]`` for float weights, the model's projections.

Backends (``_backend``'s rule): ``"reference"`` is ``jnp.einsum`` at full float32
precision, on any platform. ``"cpu"`` is the C++ kernel of ``cpu.py``. ``"auto"`` takes
it when building for the CPU with float32 operands, whatever the number of rows, if it
could be built; otherwise the reference. Every row of every product then goes through the
same chain of FMAs, so a request's numbers (and its seeded samples) never depend on how
many rows its batch has: mixing the kernel with XLA's dots by row count broke that.
Measured on a 2-core AVX-512 CPU over SmolLM2's 30 layers of projections
(``docs/benchmarks/host_overhead.md``): 1.3x XLA's dots at 24-64 rows, 1.07x at 512;
at 16 rows and fewer, bound by reading the weights, 0.75-1.0x.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _backend
from pallas_kernels.precision import dot_precision

BACKENDS = ("auto", "reference", "cpu")


def resolve_backend(backend: str, dtype) -> str:
    """"reference" or "cpu" for a product of ``dtype`` operands here."""
    if backend not in BACKENDS:
        raise ValueError(f"dense matmul backend={backend!r} is not one of {BACKENDS}")
    if backend == "reference":
        return "reference"
    platform = _backend.current_platform()
    float32 = jnp.dtype(dtype) == jnp.float32
    if backend == "cpu":
        if platform != "cpu" or not float32:
            raise ValueError(f"dense matmul backend='cpu' needs float32 operands on the CPU, "
                             f"got {jnp.dtype(dtype)} on {platform!r}")
        from pallas_kernels.dense_matmul import cpu

        if not cpu.available():
            raise ValueError("dense matmul backend='cpu': the C++ kernel could not be built "
                             "here (no C++ compiler, or JAXPAGE_CPU_KERNELS=0)")
        return "cpu"
    if platform != "cpu" or not float32:
        return "reference"
    from pallas_kernels.dense_matmul import cpu

    return "cpu" if cpu.available() else "reference"


def dense_matmul(x: jax.Array, w: jax.Array, *, backend: str = "auto",
                 rows: jax.Array | None = None) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in the operands' dtype.

    ``rows`` (an int32 scalar, optional): only x's first ``rows`` rows (leading axes
    flattened) matter, the rest are a batch's padding. Their results are unspecified:
    the C++ kernel skips them (zeros), the reference computes them."""
    if w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"dense matmul: x {x.shape} and w {w.shape} must be [..., K] and [K, N]")
    lead = x.shape[:-1]
    count = 1
    for d in lead:
        count *= d
    if x.dtype != w.dtype or resolve_backend(backend, x.dtype) != "cpu" or count == 0:
        return jnp.einsum("...i,io->...o", x, w, precision=dot_precision(x.dtype))
    from pallas_kernels.dense_matmul.cpu import dense_matmul_cpu

    return dense_matmul_cpu(x.reshape(count, x.shape[-1]), w, rows).reshape(*lead, w.shape[1])
