"""Weight-only quantized matmul for GPUs (Pallas, Triton lowering): group-scaled codes
dequantized in registers.

Compiled for an H100, the jnp form (``reference.py``: dequantize with the group scales,
then a dot) materializes the whole dequantized weight on every call (112 MiB of bf16 for
Llama-3-8B's MLP weight, ``docs/quantization.md``): the weight's bytes are read as codes,
written as bf16 and read again, ~9x an int4 weight's own bytes. Here each program owns a
tile of output columns ``[block_m, block_n]`` and walks K a few scale groups at a time:
it loads those rows of codes and their scales (and zeros), dequantizes them in registers
and multiplies them into a float32 accumulator with ``tl.dot``; the weight is read once
per row tile, as stored.

Formats (the package's): int8 codes with or without a zero, and 4-bit codes two per byte
(row ``2i`` in the low nibble of packed row ``i``, ``2i + 1`` in the high one). As in
``tpu.py``, 4-bit activations are split into their even and odd columns outside the
kernel, so that each packed row meets its two rows of x without an interleave:
``x @ W = x[:, 0::2] @ W_low + x[:, 1::2] @ W_high``.

Every tile is dequantized as ``reference.dequantize`` computes it (``q * scale`` (+
``zero``) in float32), then cast to x's dtype for the dot, as the reference's dot takes
it. Runs on the CPU under ``interpret=True``. Compiled for H100 / A100, not timed
(``scripts/bench_quantized_matmul.py`` times it against the jnp form on a lent GPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BLOCK_N = (128, 64)   # output columns per program, the first that divides N
MIN_ROWS = 16         # tl.dot's smallest M and K
STEP_ROWS = 64        # code rows dequantized per loop step (whole groups, at least one)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(weight: dict, k: int, n: int) -> bool:
    """Whether this kernel takes the weight: plain int8 / 4-bit codes with group scales
    (one group is the reference's fused form), a power-of-two group of at least 16 code
    rows (tl.dot's K), and N a multiple of 64."""
    codes, scale = weight.get("codes"), weight["scale"]
    if codes is None or codes.ndim != 2 or scale.ndim != 2 or scale.shape[0] <= 1:
        return False
    if jnp.dtype(codes.dtype) not in (jnp.dtype(jnp.int8), jnp.dtype(jnp.uint8)):
        return False
    code_rows = codes.shape[0]
    rows_per_group = code_rows // scale.shape[0]
    return (rows_per_group * scale.shape[0] == code_rows and _pow2(rows_per_group)
            and rows_per_group >= MIN_ROWS and n % BLOCK_N[-1] == 0)


def _kernel(*refs, four: bool, has_zero: bool, rows_per_group: int, groups_per_step: int,
            num_steps: int):
    if four:
        x_lo_ref, x_hi_ref, codes_ref, scale_ref, *rest = refs
    else:
        x_ref, codes_ref, scale_ref, *rest = refs
    zero_ref = rest.pop(0) if has_zero else None
    (out_ref,) = rest
    block_m, block_n = out_ref.shape
    step_rows = rows_per_group * groups_per_step

    def dequantized(q, step, dtype):                  # q [step_rows, block_n] float32
        groups = pl.ds(step * groups_per_step, groups_per_step)
        scale = scale_ref[groups, :].astype(jnp.float32)                # [g, block_n]
        w = q.reshape(groups_per_step, rows_per_group, block_n) * scale[:, None, :]
        if zero_ref is not None:
            w = w + zero_ref[groups, :].astype(jnp.float32)[:, None, :]
        return w.reshape(step_rows, block_n).astype(dtype)

    def step(s, acc):
        rows = pl.ds(s * step_rows, step_rows)
        codes = codes_ref[rows, :].astype(jnp.int32)                   # [step_rows, block_n]
        pairs = ([(x_lo_ref, codes & 15), (x_hi_ref, codes >> 4)] if four
                 else [(x_ref, codes)])
        for ref, q in pairs:
            x = ref[:, rows]                                             # [block_m, step_rows]
            precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
            acc += jnp.dot(x, dequantized(q.astype(jnp.float32), s, x.dtype),
                           precision=precision, preferred_element_type=jnp.float32)
        return acc

    acc = lax.fori_loop(0, num_steps, step, jnp.zeros((block_m, block_n), jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "block_m", "num_warps",
                                             "num_stages"))
def quantized_matmul_gpu(x: jax.Array, weight: dict[str, jax.Array], *,
                         interpret: bool = False, block_m: int = 64, num_warps: int = 4,
                         num_stages: int = 2) -> jax.Array:
    """x [M, K] @ W -> [M, N] in x's dtype, W a plain quantized weight (``supported``)."""
    codes, scale = weight["codes"], weight["scale"]
    four = codes.dtype == jnp.uint8
    has_zero = "zero" in weight
    code_rows, n = codes.shape
    groups = scale.shape[0]
    rows_per_group = code_rows // groups
    groups_per_step = max(1, min(groups, STEP_ROWS // rows_per_group))
    while groups % groups_per_step:
        groups_per_step //= 2
    m = x.shape[0]
    bm = min(block_m, max(MIN_ROWS, 1 << (m - 1).bit_length()))       # a power of two
    padded = -(-m // bm) * bm
    if padded != m:
        x = jnp.pad(x, ((0, padded - m), (0, 0)))
    bn = next(b for b in BLOCK_N if n % b == 0)
    xs = [x[:, 0::2], x[:, 1::2]] if four else [x]           # [M, K/2] each, or [M, K]
    x_spec = pl.BlockSpec((bm, code_rows), lambda i, j: (i, 0))
    column_spec = lambda rows: pl.BlockSpec((rows, bn), lambda i, j: (0, j))  # noqa: E731
    specs = [x_spec] * len(xs) + [column_spec(code_rows), column_spec(groups)]
    operands = [*xs, codes, scale]
    if has_zero:
        specs.append(column_spec(groups))
        operands.append(weight["zero"])
    kernel = functools.partial(_kernel, four=four, has_zero=has_zero,
                               rows_per_group=rows_per_group, groups_per_step=groups_per_step,
                               num_steps=groups // groups_per_step)
    out = pl.pallas_call(
        kernel,
        grid=(padded // bm, n // bn),
        in_specs=specs,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((padded, n), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"quantized_matmul_gpu_{'q4' if four else 'q8'}_m{bm}_n{bn}_g{rows_per_group}",
    )(*operands)
    return out[:m]
