"""Which implementation of a kernel runs: the rule shared by every public kernel function.

``"auto"`` picks by platform (``current_platform()``): the Pallas GPU kernel on a GPU,
the Pallas TPU kernel on a TPU, the plain-jnp reference anywhere else (the CPU).
``"gpu"`` / ``"tpu"`` force a Pallas kernel; ``"cpu"`` forces a kernel family's hand-written
C++ CPU kernel (an XLA FFI call, see ``_cpu_build``) where it has one. A Pallas kernel runs compiled only on its own
platform; with ``interpret=True`` it runs in Pallas interpret mode on any platform (that is
how the CPU tests run it). Asking for a compiled kernel on the wrong platform raises a
``ValueError`` instead of failing deep inside the compiler.
"""

from __future__ import annotations

import re
from typing import Any

import jax

BACKENDS = ("auto", "reference", "cpu", "gpu", "tpu")

_PLATFORM_BACKEND = {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def current_platform() -> str:
    """The platform programs are being built for.

    That is the platform of JAX's default device when one is set (``with
    jax.default_device(device)``; this is how a program is compiled for a TPU or GPU
    target that is not there, see ``jaxpage.parallel.targets``), else
    ``jax.default_backend()``.
    """
    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend()
    return device if isinstance(device, str) else device.platform


def current_device() -> jax.Device:
    """The device programs are being built for: JAX's default device when one is set (a
    deviceless target's, ``jaxpage.parallel.targets``), else the first device."""
    device = jax.config.jax_default_device
    if device is None or isinstance(device, str):
        return jax.devices()[0]
    return device


_FP8_GPUS = re.compile(r"H100|H200|H20\b|H800|GH200|L4\b|L40|B100|B200|GB200|B300|RTX 40|RTX 50|"
                       r"Ada|Hopper|Blackwell", re.IGNORECASE)


def has_fp8_units(device: Any = None) -> bool:
    """Whether ``device`` (default: ``current_device()``, a deviceless target's included)
    is a GPU with FP8 conversions and tensor cores (compute capability >= 8.9); Triton
    compiles no FP8 conversion below that (``kv_quant.decode_in_integers``)."""
    device = current_device() if device is None else device
    if platform_backend(device.platform) != "gpu":
        return False
    capability = getattr(device, "compute_capability", None)
    if capability:
        major, minor = (int(part) for part in str(capability).split(".")[:2])
        return (major, minor) >= (8, 9)
    return bool(_FP8_GPUS.search(str(getattr(device, "device_kind", ""))))


def runs_ptx(device: Any = None) -> bool:
    """Whether ``device`` (default: ``current_device()``) is a GPU that Triton compiles PTX
    for (NVIDIA's): the GPU kernels' inline PTX then applies. A ROCm client (whose
    ``platform_version`` names it) is not; deviceless CUDA targets are."""
    device = current_device() if device is None else device
    if platform_backend(device.platform) != "gpu" or device.platform == "rocm":
        return False
    version = str(getattr(getattr(device, "client", None), "platform_version", ""))
    return "rocm" not in version.lower()


def platform_backend(platform: str | None = None) -> str:
    """The kernel backend that ``"auto"`` picks on ``platform`` (default: ``current_platform()``)."""
    return _PLATFORM_BACKEND.get(platform or current_platform(), "reference")


def branches_wait_for_device(platform: str | None = None) -> bool:
    """Whether a data-dependent branch inside a program makes the host wait for the device
    on ``platform`` (default: ``current_platform()``).

    XLA:GPU runs a conditional by copying its predicate to the host and blocking on the
    stream before it picks the branch, and a while loop without a known trip count does
    the same every iteration: the thread that launched the program waits for everything
    queued before it, the previous step included. On the CPU and the TPU the branch is
    decided without the host.
    """
    return platform_backend(platform) == "gpu"


def resolve(backend: str, *, interpret: bool = False, platform: str | None = None,
            auto: str | None = None) -> str:
    """The concrete backend ("reference", "gpu" or "tpu") for a request.

    ``auto`` overrides what ``"auto"`` means (a kernel family may keep the reference on a
    platform where its Pallas version has not been shown to be faster).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    platform = platform or current_platform()
    if backend == "auto":
        return auto if auto is not None else platform_backend(platform)
    if backend == "cpu" and platform != "cpu":
        raise ValueError(f"backend='cpu': the C++ CPU kernel runs only on the CPU, but the "
                         f"platform is {platform!r}; use backend='auto'")
    if backend in ("gpu", "tpu") and not interpret and platform_backend(platform) != backend:
        raise ValueError(
            f"backend={backend!r}: the compiled Pallas {backend.upper()} kernel needs a "
            f"{backend.upper()}, but the platform is {platform!r}; pass "
            f"interpret=True to run the kernel in Pallas interpret mode, or use "
            f"backend='reference' or 'auto'")
    return backend


def layer_view(k_cache, v_cache, layer: int | None, head_dim: int | None = None):
    """The shape of one layer's pages as split ``[N, B, Hkv, D]``, for the shape checks.

    Split caches (``v_cache`` given): ``k_cache`` itself without ``layer``; with it, the
    caches must be every layer's ``[L, N, B, Hkv, D]``. Fused caches (``v_cache`` None,
    ``kv_layout``): ``[(L,) N, B, W]``, read at ``head_dim``. Raises ``ValueError``
    otherwise."""
    if v_cache is None:
        from pallas_kernels import kv_layout
        if k_cache.ndim != (3 if layer is None else 4):
            raise ValueError(f"a fused KV cache is [{'' if layer is None else 'num_layers, '}"
                             f"num_blocks, block_size, row_width], got {k_cache.shape}")
        heads = kv_layout.heads_in_row(k_cache.shape[-1], head_dim)
        view = (*k_cache.shape[-3:-1], heads, head_dim)
    else:
        if layer is not None and (k_cache.ndim != 5 or k_cache.shape != v_cache.shape):
            raise ValueError(f"with layer={layer}, k_cache and v_cache must both be "
                             f"[num_layers, num_blocks, block_size, num_kv_heads, head_dim], "
                             f"got {k_cache.shape} and {v_cache.shape}")
        if layer is None:
            return k_cache
        view = k_cache.shape[1:]
    if layer is not None and not 0 <= layer < k_cache.shape[0]:
        raise ValueError(f"layer={layer} is out of range for {k_cache.shape[0]} layers")
    return jax.ShapeDtypeStruct(view, k_cache.dtype)


def searchsorted_right(sorted_values, queries):
    """``jnp.searchsorted(sorted_values, queries, side="right")`` in the form that suits the
    platform: a binary search (a loop of log2(n) steps) on the CPU, and on GPUs and TPUs
    one comparison of every query with every value (one fused kernel: on a GPU XLA runs
    each step of the search's loop as its own launches, ~15 of them per call, and the
    arrays here are the size of a batch's sequences)."""
    import jax.numpy as jnp

    method = "scan" if current_platform() == "cpu" else "compare_all"
    return jnp.searchsorted(sorted_values, queries, side="right", method=method)
