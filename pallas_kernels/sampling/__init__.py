"""The last step of sampling: one token per row from adjusted logits (greedy, or
Gumbel-max over a temperature-scaled, thresholded row), with per-row random streams.

Backends (``_backend``'s rule): ``"reference"`` is plain jnp (``reference.py``) on any
platform; ``"cpu"`` is the C++ kernel (``cpu.py``), one pass over each row instead of
XLA:CPU's several slow reductions. ``"auto"`` takes the C++ kernel when building for the
CPU and it could be built, else the reference (TPU and GPU: XLA fuses the reference well).
"""

from __future__ import annotations

import jax

from pallas_kernels import _backend
from pallas_kernels.sampling import reference
from pallas_kernels.sampling.reference import first_argmax, gumbel_noise  # noqa: F401

BACKENDS = ("auto", "reference", "cpu")


def resolve_backend(backend: str = "auto") -> str:
    """"reference" or "cpu" for ``backend`` here; ``"cpu"`` raises a ``ValueError`` when
    the platform is not the CPU or the kernel could not be built."""
    if backend not in BACKENDS:
        raise ValueError(f"sampling backend={backend!r} is not one of {BACKENDS}")
    platform = _backend.current_platform()
    if backend == "cpu" and platform != "cpu":
        raise ValueError(f"sampling backend='cpu': the C++ kernel runs only on the CPU, but "
                         f"the platform is {platform!r}; use backend='auto'")
    if backend == "reference" or (backend == "auto" and platform != "cpu"):
        return "reference"
    import pallas_kernels.sampling.cpu as cpu

    if cpu.available():
        return "cpu"
    if backend == "cpu":
        raise ValueError("sampling backend='cpu': the C++ kernel is unavailable here "
                         f"(platform {platform!r}, or no C++ compiler / JAXPAGE_CPU_KERNELS=0)")
    return "reference"


def sample_rows(logits: jax.Array, temperature: jax.Array, threshold: jax.Array,
                min_p: jax.Array, seeds: jax.Array, index: jax.Array, *,
                backend: str = "auto", stochastic: bool | None = None) -> jax.Array:
    """int32 [S]: one token per row of ``logits`` float32 [S, V]; see
    ``reference.sample_rows`` for the rule and ``stochastic`` (the C++ kernel handles
    greedy and sampled rows in its one pass and ignores it)."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [S, V], got shape {logits.shape}")
    rows = logits.shape[0]
    for name, x in (("temperature", temperature), ("threshold", threshold),
                    ("min_p", min_p), ("seeds", seeds), ("index", index)):
        if tuple(x.shape) != (rows,):
            raise ValueError(f"{name} must be [{rows}] (one per row), got shape {x.shape}")
    if resolve_backend(backend) == "cpu":
        from pallas_kernels.sampling.cpu import sample_rows_cpu

        return sample_rows_cpu(logits, temperature, threshold, min_p, seeds, index)
    return reference.sample_rows(logits, temperature, threshold, min_p, seeds, index,
                                 stochastic=stochastic)
