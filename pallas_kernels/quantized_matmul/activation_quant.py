"""Matmuls that quantize their input too (W8A8), where the hardware multiplies such codes.

A W8A8 checkpoint stores 8-bit weights with one scale per output channel (a per-tensor
scale is stored repeated) and says how the activations were quantized when it was made:
per token at run time (``"dynamic"``: ``s_x = max|x_row| / qmax``) or by a per-tensor
scale it stores (``"static"``: ``input_scale``). Then

    y[m, n] = (sum_k x_q[m, k] * W_q[k, n]) * s_x[m] * s_w[n]

with the dot over the 8-bit codes, accumulated in float32 (FP8) or int32 (int8).

Where it runs (``runs_natively``), chosen per platform:

* FP8 codes: GPUs with FP8 tensor cores (compute capability >= 8.9: H100, H200, L4, B200):
  XLA:GPU rewrites the scaled f8 x f8 dot into a cuBLASLt FP8 GEMM.
* int8 codes: TPUs (the MXU multiplies int8 on v5e and v6e) and GPUs (int8 tensor cores).
* Anywhere else, and for weights with group scales: weight-only. The weight is
  dequantized in the matmul: FP8 on a TPU (v5e / v6e have no FP8 units), everything on
  the CPU. The activations stay in the model dtype, or, for a format whose own runtime
  quantizes them on every platform (compressed-tensors: ``QuantFormat.emulated``), are
  first rounded to their codes and back (``round_trip``), so the matmul sees what the
  checkpoint's author calibrated and what Hugging Face computes on any device.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import _backend

# per codes dtype: what a row's max |x| maps to, and the codes' range. int8 as
# compressed-tensors quantizes activations: amax * 2 / 255, half to even, -128..127.
QMAX = {jnp.dtype(jnp.float8_e4m3fn): 448.0, jnp.dtype(jnp.int8): 127.5}
CODE_RANGE = {jnp.dtype(jnp.float8_e4m3fn): (-448.0, 448.0), jnp.dtype(jnp.int8): (-128.0, 127.0)}
def runs_natively(codes_dtype: Any, groups: int, platform: str | None = None,
                  device: Any = None) -> bool:
    """Whether a W8A8 weight (``codes_dtype``, ``groups`` scale groups along K) multiplies
    quantized activations on the platform programs are built for (see the module);
    ``device``: the target device (default: the one programs are built for)."""
    if groups != 1:
        return False
    if device is None:
        device, platform = _backend.current_device(), platform or _backend.current_platform()
    else:
        platform = platform or device.platform
    backend = _backend.platform_backend(platform)
    if jnp.dtype(codes_dtype) == jnp.int8:
        return backend in ("gpu", "tpu")
    if jnp.dtype(codes_dtype) == jnp.float8_e4m3fn:
        return backend == "gpu" and _backend.has_fp8_units(device)
    return False


def native_codes(platform: str | None = None) -> str:
    """The 8-bit codes whose W8A8 matmuls run natively here ("fp8,int8", "int8", ""):
    part of what a compiled program depends on (``runtime.executable_cache``)."""
    dtypes = (("fp8", jnp.float8_e4m3fn), ("int8", jnp.int8))
    return ",".join(name for name, dtype in dtypes if runs_natively(dtype, 1, platform))


def activation_scales(x: jax.Array, scheme: str, qmax: float,
                      input_scale: jax.Array | None = None, dtype: Any = jnp.float32
                      ) -> jax.Array:
    """``dtype`` [..., 1] for x [..., K]: per row ``max|x| / qmax`` ("dynamic"; over the
    last axis, so x [M, G, g] gives one per row and group), or the stored per-tensor
    ``input_scale`` [1] ("static") for every row."""
    if scheme == "static":
        if input_scale is None:
            raise ValueError("static activation quantization needs the stored input_scale")
        return jnp.broadcast_to(input_scale.astype(dtype).reshape((1,) * x.ndim),
                                (*x.shape[:-1], 1))
    if scheme not in ("dynamic", "dynamic_group"):
        raise ValueError(f"activation scheme {scheme!r} is not 'dynamic', 'dynamic_group' "
                         "or 'static'")
    amax = jnp.max(jnp.abs(x.astype(dtype)), axis=-1, keepdims=True)
    # divided, not multiplied by XLA's 1 / qmax (127.5's reciprocal is inexact in float32)
    return jnp.maximum(amax, 1e-12) / jax.lax.optimization_barrier(jnp.full_like(amax, qmax))


def quantize_activations(x: jax.Array, scales: jax.Array, codes_dtype: Any,
                         exact_division: bool = False, dtype: Any = jnp.float32) -> jax.Array:
    """x [..., K] / scales [..., 1] (in ``dtype``) as ``codes_dtype`` codes (int8 rounded
    half to even; saturating at the codes' range). ``exact_division``: divide as
    compressed-tensors does. XLA turns x / broadcast(s) into x * broadcast(1 / s), and a
    row's max |x| then lands an ulp off +-127.5, where int8 rounds it the other way; a
    barrier keeps the divisor opaque, at the cost of writing it out like x (the emulated
    path on the CPU only, where float32 models are compared with Hugging Face's; the
    native path multiplies int32 sums, which round apart from float ones anyway)."""
    low, high = CODE_RANGE[jnp.dtype(codes_dtype)]
    divisor = scales
    if exact_division:
        divisor = jax.lax.optimization_barrier(jnp.broadcast_to(scales, x.shape))
    scaled = x.astype(dtype) / divisor
    if jnp.dtype(codes_dtype) == jnp.int8:
        scaled = jnp.round(scaled)
    return jnp.clip(scaled, low, high).astype(codes_dtype)


def round_trip(x: jax.Array, scheme: str, codes_dtype: Any, groups: int = 1,
               input_scale: jax.Array | None = None) -> jax.Array:
    """x [M, K] quantized to ``codes_dtype`` by ``scheme`` and multiplied back, in x's dtype:
    the activations a W8A8 matmul multiplies, for a weight-only one (``QuantFormat.
    emulated``). ``"dynamic_group"``: a scale per row and each of ``groups`` equal runs of
    K (the weight's scale groups; x is viewed [M, G, g], so a K split across devices
    stays split). As compressed-tensors does, the scales and the division are in the
    activations' dtype (float32, or bfloat16 / float16 for such models)."""
    codes = jnp.dtype(codes_dtype)
    work = x.dtype if x.dtype in (jnp.bfloat16, jnp.float16) else jnp.dtype(jnp.float32)
    m, k = x.shape
    split = groups if scheme == "dynamic_group" else 1
    if k % split:
        raise ValueError(f"{split} activation groups do not divide K={k}")
    rows = x.reshape(m, split, k // split)                                     # [M, G, g]
    scales = activation_scales(rows, scheme, QMAX[codes], input_scale, work)   # [M, G, 1]
    q = quantize_activations(rows, scales, codes, dtype=work,
                             exact_division=_backend.current_platform() == "cpu")
    return (q.astype(work) * scales).reshape(m, k).astype(x.dtype)


def w8a8_matmul(x: jax.Array, weight: dict[str, jax.Array], scheme: str,
                input_scale: jax.Array | None = None) -> jax.Array:
    """x [M, K] @ W -> float32 [M, N], W 8-bit codes [K, N] (``codes``) or [N, K]
    (``codes_t``: the layout a GPU's 8-bit GEMM reads without a transpose) with scale
    [1, N], x quantized to the same codes by ``scheme``."""
    transposed = "codes_t" in weight
    codes, scale = weight["codes_t" if transposed else "codes"], weight["scale"]
    if scale.shape[0] != 1 or "zero" in weight:
        raise ValueError(f"W8A8 needs symmetric per-channel weight scales, got scale "
                         f"{tuple(scale.shape)} and parts {sorted(weight)}")
    dtype = jnp.dtype(codes.dtype)
    scales = activation_scales(x, scheme, QMAX[dtype], input_scale)       # [M, 1]
    x_q = quantize_activations(x, scales, dtype)                        # [M, K]
    accumulate = jnp.int32 if dtype == jnp.int8 else jnp.float32
    contract = (((1,), (1 if transposed else 0,)), ((), ()))
    acc = jax.lax.dot_general(x_q, codes, contract, preferred_element_type=accumulate)  # [M, N]
    return acc.astype(jnp.float32) * scales * scale.astype(jnp.float32)
