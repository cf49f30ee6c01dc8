"""Weight-only quantized matmul for TPUs (Pallas Mosaic): the codes dequantized in VMEM.

Compiled for a v5e, the jnp form (``reference.py``: dequantize with the group scales, then
a dot) materializes the whole dequantized weight in HBM on every call (224 MiB of float32
for Llama-3-8B's MLP weight), so the weight's bytes are read, written and read again. Here
each grid step loads a tile of codes ``[block_k, block_n]`` and its scales (and zeros),
dequantizes it in VMEM, and multiplies it into a float32 accumulator ``[block_m, block_n]``
on the MXU; the weight is read from HBM once per row tile, as stored.

Formats (the package's): int8 codes with or without a zero, and 4-bit codes two per byte
(row ``2i`` in the low nibble of packed row ``i``, ``2i + 1`` in the high one). For 4-bit
codes the activations are split outside the kernel into their even and odd columns, so
that each packed row of codes meets the two rows of x it multiplies without interleaving
inside the kernel: ``x @ W = x[:, 0::2] @ W_low + x[:, 1::2] @ W_high``.

Every tile is dequantized exactly as ``reference.dequantize`` computes it (``q * scale``
(+ ``zero``) in float32), then cast to x's dtype for the MXU, as the reference's dot does.
Runs on the CPU under ``interpret=True`` (``pltpu.InterpretParams()``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

N_TILES = (512, 256, 128)
K_TILES = (1024, 512, 256)  # rows of codes per step; their scales must fill 8 sublanes
MAX_WHOLE_K = 2048          # a whole K as one block, when no tile fits (VMEM bound)


def _n_tile(n: int) -> int:
    return next(tile for tile in N_TILES if n % tile == 0)


def _k_tile(code_rows: int, rows_per_group: int) -> int | None:
    """Rows of codes per grid step: a tile of ``K_TILES`` dividing them whose scale rows
    are a multiple of 8 (Mosaic's sublane rule), else all of them if few enough."""
    for tile in K_TILES:
        if code_rows % tile == 0 and tile % rows_per_group == 0 and \
                (tile // rows_per_group) % 8 == 0:
            return tile
    return code_rows if code_rows <= MAX_WHOLE_K else None


def supported(weight: dict, k: int, n: int) -> bool:
    """Whether this kernel takes the weight: a plain layout with group scales (one group
    is the reference's fused form), N a multiple of 128, and a K tiling (``_k_tile``)."""
    codes, scale = weight.get("codes"), weight["scale"]
    if codes is None or codes.ndim != 2 or scale.shape[0] <= 1 or n % 128:
        return False
    if jnp.dtype(codes.dtype) not in (jnp.dtype(jnp.int8), jnp.dtype(jnp.uint8)):
        return False
    code_rows = codes.shape[0]
    rows_per_group = code_rows // scale.shape[0]
    return rows_per_group % 8 == 0 and _k_tile(code_rows, rows_per_group) is not None


def _kernel(*refs, four: bool, has_zero: bool, rows_per_group: int, last_k: int):
    if four:
        x_lo_ref, x_hi_ref, codes_ref, scale_ref, *rest = refs
    else:
        x_ref, codes_ref, scale_ref, *rest = refs
    zero_ref = rest.pop(0) if has_zero else None
    out_ref, acc_ref = rest
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    rows, cols = codes_ref.shape                       # [block_k, block_n] of codes
    groups = rows // rows_per_group
    scale = scale_ref[...].astype(jnp.float32)[:, None, :]                # [g, 1, n]
    zero = None if zero_ref is None else zero_ref[...].astype(jnp.float32)[:, None, :]

    def dequantized(q: jax.Array, dtype) -> jax.Array:
        w = q.astype(jnp.float32).reshape(groups, rows_per_group, cols) * scale
        if zero is not None:
            w = w + zero
        return w.reshape(rows, cols).astype(dtype)

    codes = codes_ref[...].astype(jnp.int32)
    pairs = ([(x_lo_ref[...], codes & 15), (x_hi_ref[...], codes >> 4)] if four
             else [(x_ref[...], codes)])
    for x, q in pairs:  # float32 activations: a true float32 product, as the reference's
        precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
        acc_ref[...] += jnp.dot(x, dequantized(q, x.dtype), precision=precision,
                                preferred_element_type=jnp.float32)

    @pl.when(k == last_k)
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "block_m"))
def quantized_matmul_tpu(x: jax.Array, weight: dict[str, jax.Array], *,
                         interpret: bool = False, block_m: int = 256) -> jax.Array:
    """x [M, K] @ W -> [M, N] in x's dtype, W a plain quantized weight (``supported``)."""
    codes, scale = weight["codes"], weight["scale"]
    four = codes.dtype == jnp.uint8
    has_zero = "zero" in weight
    code_rows, n = codes.shape
    rows_per_group = code_rows // scale.shape[0]
    m = x.shape[0]
    sublanes = 16 if x.dtype == jnp.bfloat16 else 8
    bm = min(block_m, -(-m // sublanes) * sublanes)
    padded = -(-m // bm) * bm
    if padded != m:
        x = jnp.pad(x, ((0, padded - m), (0, 0)))
    bk = _k_tile(code_rows, rows_per_group)
    bn = _n_tile(n)
    xs = [x[:, 0::2], x[:, 1::2]] if four else [x]           # [M, K/2] each, or [M, K]
    x_spec = pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk))
    specs = [x_spec] * len(xs) + [
        pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
        pl.BlockSpec((bk // rows_per_group, bn), lambda i, j, kk: (kk, j))]
    operands = [*xs, codes, scale]
    if has_zero:
        specs.append(pl.BlockSpec((bk // rows_per_group, bn), lambda i, j, kk: (kk, j)))
        operands.append(weight["zero"])
    grid = (padded // bm, n // bn, code_rows // bk)
    kernel = functools.partial(_kernel, four=four, has_zero=has_zero,
                               rows_per_group=rows_per_group, last_k=grid[2] - 1)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=specs,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((padded, n), x.dtype),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(*operands)
    return out[:m]
