"""Matmuls whose weight is stored quantized (weight-only: activations stay in the model dtype).

A quantized weight W [K, N] (in_features x out_features, the model's layout) is a dict
of arrays, its scales per group of ``K / G`` consecutive rows:

* 8-bit, symmetric: ``{"codes": int8 [K, N], "scale": float32 [G, N]}``,
  ``W[k, n] = scale[k // (K/G), n] * codes[k, n]``. Per output channel is ``G = 1``.
  With a ``zero`` [G, N] (an asymmetric int8 checkpoint's): ``+ zero[g, n]``.
* FP8: ``{"codes": float8_e4m3fn [K, N], "scale": float32 [G, N]}``, the same formula
  (pre-quantized FP8 checkpoints; a per-tensor scale is stored repeated per channel).
* 4-bit, asymmetric: ``{"codes": uint8 [K/2, N], "scale": float32 [G, N],
  "zero": float32 [G, N]}``: two codes per byte (row ``2i`` in the low nibble of byte row
  ``i``, row ``2i + 1`` in the high nibble), ``W[k, n] = scale[g, n] * q[k, n] + zero[g, n]``
  with ``q`` in 0..15.

GGUF's Q8_0, Q4_0 and Q4_1 blocks (32 weights along K) are these formats with ``G = K/32``.

Packed by panels (``pack_panels``; ``N`` a multiple of 64): the same values with each block
of 64 columns contiguous, codes ``[N/64, K or K/2, 64]`` and scale / zero
``[N/64, G, 64]``. The CPU kernels read a packed weight as one stream per panel (a decode
step's few rows ~1.6x as fast as the plain layout, whose panel rows lie N bytes apart);
every function here accepts either layout.

Backends (``_backend``'s rule): ``"reference"`` dequantizes in jnp and calls an ordinary
dot; with one scale group (per channel / tensor) it scales after the dot, and XLA fuses
the conversion into the dot on TPUs and GPUs, so the weight is read as stored. With group
scales XLA materializes the dequantized weight per call instead: ``"auto"`` takes a Pallas
kernel that dequantizes tiles on chip, ``tpu.py`` on a TPU (in VMEM) and ``gpu.py`` on a
GPU (in registers, Triton). On the CPU that fusion is slow (XLA converts int8 at ~1 ns an element),
so ``"auto"`` there takes the C++ kernels of ``cpu.py`` for float32 activations and int8
or 4-bit codes (FP8 codes take the jnp form): each panel of 64 columns is converted once
into a buffer and multiplied by ``dense_matmul``'s register tiles, so the products are
bit for bit those of ``dense_matmul`` on the dequantized weight, at any number of rows.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _backend
from pallas_kernels.quantized_matmul import activation_quant, gpu, reference, tpu

BACKENDS = ("auto", "reference", "cpu", "tpu", "gpu")
PANEL = 64  # columns of a packed panel (the CPU kernels' panel width)


WEIGHT_PARTS = ("codes", "scale", "zero")  # laid out like W; others (input_scale) are not
CODE_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.uint8), jnp.dtype(jnp.float8_e4m3fn))


def is_four_bit(weight: dict[str, Any]) -> bool:
    """Whether a quantized weight's codes are 4-bit (uint8, two per byte)."""
    return "codes" in weight and jnp.dtype(weight["codes"].dtype) == jnp.uint8


def cpu_kernel_reads(weight: dict[str, Any]) -> bool:
    """Whether the C++ CPU kernels read this format: int8 codes (with a zero or without)
    or 4-bit codes; FP8 codes run the jnp form."""
    return is_four_bit(weight) or ("codes" in weight
                                    and jnp.dtype(weight["codes"].dtype) == jnp.int8)


def is_quantized(weight: Any) -> bool:
    """Whether ``weight`` is a quantized weight dict (not a plain array)."""
    return isinstance(weight, dict) and ("codes" in weight or "codes_t" in weight)


def untransposed(weight: dict[str, Any]) -> dict[str, Any]:
    """A weight with W8A8 codes kept ``[N, K]`` (``codes_t``) as plain ``codes [K, N]``."""
    if "codes_t" not in weight:
        return weight
    out = {name: part for name, part in weight.items() if name != "codes_t"}
    out["codes"] = weight["codes_t"].T
    return out


def is_packed(weight: dict[str, Any]) -> bool:
    """Whether a quantized weight is packed by panels (``pack_panels``)."""
    return "codes" in weight and len(weight["codes"].shape) == 3


def pack_panels(weight: dict[str, Any]) -> dict[str, Any]:
    """A plain quantized weight (numpy or jax arrays) packed by panels of 64 columns:
    each part [R, N] -> [N / 64, R, 64], the same values. ``ValueError`` unless plain with
    N a multiple of 64."""
    _, n = weight_shape(weight)
    if is_packed(weight) or n % PANEL:
        raise ValueError(f"pack_panels: needs a plain weight with N a multiple of {PANEL}, "
                         f"got codes {tuple(weight['codes'].shape)}")
    out = {}
    for name, part in weight.items():
        if name not in WEIGHT_PARTS:
            out[name] = part
            continue
        panels = part.reshape(part.shape[0], n // PANEL, PANEL).transpose(1, 0, 2)
        out[name] = np.ascontiguousarray(panels) if isinstance(part, np.ndarray) else panels
    return out


def unpack_panels(weight: dict[str, Any]) -> dict[str, Any]:
    """The plain layout of a weight packed by panels (a plain weight is returned as is)."""
    if not is_packed(weight):
        return weight
    out = {}
    for name, part in weight.items():
        if name not in WEIGHT_PARTS:
            out[name] = part
            continue
        panels, rows, _ = part.shape
        plain = part.transpose(1, 0, 2).reshape(rows, panels * PANEL)
        out[name] = np.ascontiguousarray(plain) if isinstance(part, np.ndarray) else plain
    return out


def weight_shape(weight: dict[str, Any]) -> tuple[int, int]:
    """(K, N) of a quantized weight, plain or packed by panels (or W8A8 codes kept
    ``[N, K]``); raises ``ValueError`` when its parts disagree."""
    if "codes_t" in weight:
        codes_t = weight["codes_t"]
        weight = {**weight, "codes": jax.ShapeDtypeStruct(tuple(codes_t.shape)[::-1],
                                                          codes_t.dtype)}
        del weight["codes_t"]
    codes, scale = weight["codes"], weight["scale"]
    four = is_four_bit(weight)
    if jnp.dtype(codes.dtype) not in CODE_DTYPES or (four and "zero" not in weight) or (
            jnp.dtype(codes.dtype) == jnp.float8_e4m3fn and "zero" in weight):
        raise ValueError(f"quantized weight codes must be int8, float8_e4m3fn (no zero) or "
                         f"uint8 (4-bit, with a zero), got {codes.dtype} with parts "
                         f"{sorted(weight)}")
    if len(codes.shape) == 3:
        return _packed_shape(weight, four)
    if codes.ndim != 2 or scale.ndim != 2 or scale.shape[1] != codes.shape[1]:
        raise ValueError(f"quantized weight: codes {codes.shape} and scale {scale.shape} "
                         "must be [K, N] and [G, N]")
    k = codes.shape[0] * (2 if four else 1)
    if k % scale.shape[0] or (four and (k // scale.shape[0]) % 2):
        raise ValueError(f"quantized weight: {scale.shape[0]} groups do not divide K={k}"
                         + (" into even groups" if four else ""))
    if "zero" in weight and tuple(weight["zero"].shape) != tuple(scale.shape):
        raise ValueError(f"quantized weight: zero {weight['zero'].shape} must match scale "
                         f"{scale.shape}")
    return k, codes.shape[1]


def _packed_shape(weight: dict[str, Any], four: bool) -> tuple[int, int]:
    codes, scale = weight["codes"], weight["scale"]
    shapes = {name: tuple(part.shape) for name, part in weight.items()}
    if (len(scale.shape) != 3 or codes.shape[2] != PANEL or scale.shape[2] != PANEL
            or scale.shape[0] != codes.shape[0]
            or ("zero" in weight and tuple(weight["zero"].shape) != tuple(scale.shape))):
        raise ValueError(f"quantized weight packed by panels: parts {shapes} must be codes "
                         f"[P, R, {PANEL}] and scale (zero) [P, G, {PANEL}]")
    k = codes.shape[1] * (2 if four else 1)
    groups = scale.shape[1]
    if groups <= 0 or k % groups or (four and (k // groups) % 2):
        raise ValueError(f"quantized weight: {groups} groups do not divide K={k}"
                         + (" into even groups" if four else ""))
    return k, codes.shape[0] * PANEL


def resolve_backend(backend: str, dtype: Any) -> str:
    """"reference", "cpu", "tpu" or "gpu" for activations of ``dtype`` here (building the
    kernels). ``"tpu"`` / ``"gpu"``: the Pallas kernels of ``tpu.py`` / ``gpu.py``
    (group-scaled weights on that platform)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    platform = _backend.current_platform()
    if backend == "cpu" and platform != "cpu":
        raise ValueError(f"backend='cpu' runs only on the CPU, but the platform is {platform!r}")
    for chip, name in (("tpu", "a TPU"), ("gpu", "a GPU")):
        if backend == chip and _backend.platform_backend(platform) != chip:
            raise ValueError(f"backend={chip!r} runs only on {name}, but the platform is "
                             f"{platform!r}")
    if backend == "auto":
        chip = _backend.platform_backend(platform)
        backend = ("cpu" if platform == "cpu" else chip if chip in ("tpu", "gpu")
                   else "reference")
    if backend == "cpu":
        from pallas_kernels.quantized_matmul import cpu
        if jnp.dtype(dtype) != jnp.float32 or not cpu.available():
            return "reference"
    return backend


def quantized_matmul(x: jax.Array, weight: dict[str, jax.Array], *,
                     backend: str = "auto", rows: jax.Array | None = None,
                     activations: str | None = None,
                     input_scale: jax.Array | None = None,
                     emulate: bool = False) -> jax.Array:
    """``x [..., K] @ W -> [..., N]`` in x's dtype, W given quantized (see the module).
    ``rows``: as ``dense_matmul``'s (the rows past it are padding, results unspecified).
    ``activations`` ("dynamic" / "static", with the stored ``input_scale``, or
    "dynamic_group"): the checkpoint's activation quantization (W8A8), applied where the
    platform multiplies such codes natively (``activation_quant``); elsewhere the matmul
    is weight-only, its input first rounded to those codes and back with ``emulate``."""
    k, n = weight_shape(weight)
    if x.shape[-1] != k:
        raise ValueError(f"x {x.shape} and the quantized weight [{k}, {n}] disagree on K")
    lead = x.shape[:-1]
    flat = x.reshape(-1, k)
    if flat.shape[0] == 0:
        return jnp.zeros((*lead, n), x.dtype)
    groups = weight["scale"].shape[-2]
    codes_dtype = weight["codes_t" if "codes_t" in weight else "codes"].dtype
    native = (activations in ("dynamic", "static") and "zero" not in weight
              and activation_quant.runs_natively(codes_dtype, groups))
    if activations is not None and not native and emulate:  # (int4 weights: int8 inputs)
        act_codes = codes_dtype if codes_dtype == jnp.float8_e4m3fn else jnp.int8
        flat = activation_quant.round_trip(flat, activations, act_codes, groups, input_scale)
    if native:
        out = activation_quant.w8a8_matmul(flat, unpack_panels(weight), activations,
                                           input_scale)
    elif "codes_t" in weight:  # built for a GPU's 8-bit GEMM, run elsewhere: weight-only
        out = reference.quantized_matmul(flat, untransposed(weight))
    elif (resolved := resolve_backend(backend, x.dtype)) == "cpu" and cpu_kernel_reads(weight):
        from pallas_kernels.quantized_matmul import cpu
        out = cpu.quantized_matmul_cpu(flat, weight, rows)
    elif resolved == "tpu" and tpu.supported(weight, k, n):
        out = tpu.quantized_matmul_tpu(flat, weight)
    elif resolved == "gpu" and gpu.supported(weight, k, n):
        out = gpu.quantized_matmul_gpu(flat, weight)
    else:
        out = reference.quantized_matmul(flat, unpack_panels(weight))
    return out.reshape(*lead, n).astype(x.dtype)


def dequantize(weight: dict[str, jax.Array], dtype: Any = jnp.float32) -> jax.Array:
    """W [K, N] in ``dtype``."""
    weight_shape(weight)
    return reference.dequantize(unpack_panels(untransposed(weight)), dtype)


def gather_columns(weight: dict[str, jax.Array], ids: jax.Array, dtype: Any) -> jax.Array:
    """Columns ``ids`` [T] of W, as rows: ``W[:, ids].T`` -> [T, K] in ``dtype``.

    This is an embedding lookup for a table stored as a quantized ``[hidden, vocab]``
    weight (the layout a tied LM head multiplies by); only the T columns are converted.
    """
    weight_shape(weight)
    if is_packed(weight):  # part [P, R, 64] -> [R, T]: panel ids // 64, column ids % 64
        picked = {name: part[ids // PANEL, :, ids % PANEL].T for name, part in weight.items()}
    else:
        picked = {name: jnp.take(part, ids, axis=1) for name, part in weight.items()}
    return reference.dequantize(picked, dtype).T
