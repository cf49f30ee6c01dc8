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

Formats (the package's): int8 codes with or without a zero, FP8 e4m3 codes (block-scaled
FP8 checkpoints), and 4-bit codes two per byte (row ``2i`` in the low nibble of packed row
``i``, ``2i + 1`` in the high one). As in
``tpu.py``, 4-bit activations are split into their even and odd columns outside the
kernel, so that each packed row meets its two rows of x without an interleave:
``x @ W = x[:, 0::2] @ W_low + x[:, 1::2] @ W_high``.

When a decode-sized M's row and column tiles make fewer programs than ``TARGET_PROGRAMS``
(a decode step's few rows against a 1,024-wide projection: 8 programs of 128 columns), K
is split over more programs too, each summing its share of the groups into a float32 partial, and the partials
are added after the call.

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

from pallas_kernels import _backend

BLOCK_N = (128, 64)   # output columns per program, the first that divides N
MIN_ROWS = 16         # tl.dot's smallest M and K
STEP_ROWS = 64        # code rows dequantized per loop step (whole groups, at least one)
TARGET_PROGRAMS = 256  # split K until the grid has about this many programs (~2 per SM)
SPLIT_K_MAX_ROWS = 64  # ... when M (padded) is at most this
CODE_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.uint8), jnp.dtype(jnp.float8_e4m3fn))


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(weight: dict, k: int, n: int) -> bool:
    """Whether this kernel takes the weight: plain int8 / FP8 / 4-bit codes with group
    scales (one group is the reference's fused form), a power-of-two group of at least 16
    code rows (tl.dot's K), and N a multiple of 64; FP8 codes not when building for a GPU
    without FP8 conversions (compute capability < 8.9; the jnp form converts them there)."""
    codes, scale = weight.get("codes"), weight["scale"]
    if codes is None or codes.ndim != 2 or scale.ndim != 2 or scale.shape[0] <= 1:
        return False
    if jnp.dtype(codes.dtype) not in CODE_DTYPES:
        return False
    if (codes.dtype == jnp.float8_e4m3fn and _backend.platform_backend() == "gpu"
            and not _backend.has_fp8_units()):
        return False  # Triton converts FP8 from compute capability 8.9 only (the jnp form)
    code_rows = codes.shape[0]
    rows_per_group = code_rows // scale.shape[0]
    return (rows_per_group * scale.shape[0] == code_rows and _pow2(rows_per_group)
            and rows_per_group >= MIN_ROWS and n % BLOCK_N[-1] == 0)


def _kernel(*refs, four: bool, has_zero: bool, rows_per_group: int, groups_per_step: int,
            steps_per_split: int):
    if four:
        x_lo_ref, x_hi_ref, codes_ref, scale_ref, *rest = refs
    else:
        x_ref, codes_ref, scale_ref, *rest = refs
    zero_ref = rest.pop(0) if has_zero else None
    (out_ref,) = rest
    block_m, block_n = out_ref.shape[-2:]
    step_rows = rows_per_group * groups_per_step
    first = pl.program_id(2) * steps_per_split    # this program's share of K, in steps

    def dequantized(q, step, dtype):                  # q [step_rows, block_n] float32
        groups = pl.ds(step * groups_per_step, groups_per_step)
        scale = scale_ref[groups, :].astype(jnp.float32)                # [g, block_n]
        w = q.reshape(groups_per_step, rows_per_group, block_n) * scale[:, None, :]
        if zero_ref is not None:
            w = w + zero_ref[groups, :].astype(jnp.float32)[:, None, :]
        return w.reshape(step_rows, block_n).astype(dtype)

    def step(i, acc):
        s = first + i
        rows = pl.ds(s * step_rows, step_rows)
        codes = codes_ref[rows, :]                                       # [step_rows, block_n]
        if codes.dtype == jnp.float8_e4m3fn:
            pairs = [(x_ref, codes)]
        else:
            codes = codes.astype(jnp.int32)
            pairs = ([(x_lo_ref, codes & 15), (x_hi_ref, codes >> 4)] if four
                     else [(x_ref, codes)])
        for ref, q in pairs:
            x = ref[:, rows]                                             # [block_m, step_rows]
            precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
            acc += jnp.dot(x, dequantized(q.astype(jnp.float32), s, x.dtype),
                           precision=precision, preferred_element_type=jnp.float32)
        return acc

    acc = lax.fori_loop(0, steps_per_split, step, jnp.zeros((block_m, block_n), jnp.float32))
    out_ref[...] = acc.reshape(out_ref.shape).astype(out_ref.dtype)


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
    # a power of two of groups a step (the loads' shapes must be), dividing the groups
    groups_per_step = 1 << (max(1, min(groups, STEP_ROWS // rows_per_group)).bit_length() - 1)
    while groups % groups_per_step:
        groups_per_step //= 2
    num_steps = groups // groups_per_step
    m = x.shape[0]
    bm = min(block_m, max(MIN_ROWS, 1 << (m - 1).bit_length()))       # a power of two
    padded = -(-m // bm) * bm
    if padded != m:
        x = jnp.pad(x, ((0, padded - m), (0, 0)))
    bn = next(b for b in BLOCK_N if n % b == 0)
    tiles = (padded // bm) * (n // bn)
    # K split over programs (a power of two dividing the steps) to fill the GPU, for a
    # decode-sized M only: the float32 partials are splits x [M, N] (at M = 256 and N =
    # 1,024 they would outweigh an FP8 weight twice over)
    # and the partials at most a quarter of the weight's bytes
    splits = 1
    while (padded <= SPLIT_K_MAX_ROWS and tiles * splits * 2 <= TARGET_PROGRAMS
           and num_steps % (splits * 2) == 0
           and splits * 2 * padded * 4 * 4 <= code_rows * codes.dtype.itemsize):
        splits *= 2
    xs = [x[:, 0::2], x[:, 1::2]] if four else [x]           # [M, K/2] each, or [M, K]
    x_spec = pl.BlockSpec((bm, code_rows), lambda i, j, s: (i, 0))
    column_spec = lambda rows: pl.BlockSpec((rows, bn), lambda i, j, s: (0, j))  # noqa: E731
    specs = [x_spec] * len(xs) + [column_spec(code_rows), column_spec(groups)]
    operands = [*xs, codes, scale]
    if has_zero:
        specs.append(column_spec(groups))
        operands.append(weight["zero"])
    kernel = functools.partial(_kernel, four=four, has_zero=has_zero,
                               rows_per_group=rows_per_group, groups_per_step=groups_per_step,
                               steps_per_split=num_steps // splits)
    if splits == 1:
        out_spec = pl.BlockSpec((bm, bn), lambda i, j, s: (i, j))
        out_shape = jax.ShapeDtypeStruct((padded, n), x.dtype)
    else:  # float32 partials [splits, M, N], summed below
        out_spec = pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j))
        out_shape = jax.ShapeDtypeStruct((splits, padded, n), jnp.float32)
    codes_name = "q4" if four else "f8" if codes.dtype == jnp.float8_e4m3fn else "q8"
    out = pl.pallas_call(
        kernel,
        grid=(padded // bm, n // bn, splits),
        in_specs=specs,
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"quantized_matmul_gpu_{codes_name}_m{bm}_n{bn}_g{rows_per_group}_k{splits}",
    )(*operands)
    if splits > 1:
        out = out.sum(axis=0).astype(x.dtype)
    return out[:m]
