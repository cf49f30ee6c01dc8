#!/usr/bin/env python3
"""Tune and measure the Pallas GPU attention kernel on the GPU at hand, in one run.

What it does, in order, within ``--budget-s`` seconds of searching:

1. the two ceilings: the device's memory bandwidth (a 1 GiB elementwise copy, bytes read
   plus written) and its bf16 matrix rate (an 8192^3 product);
2. **decode** at Llama-3-8B's heads (32 query / 8 KV heads, head_dim 128, block 16) for
   each ``--decode-shapes`` (batch x context) and each ``--kv-formats`` (bfloat16, int8,
   fp8_e4m3): candidate tilings (``gpu_config.GpuKernelConfig``: KV tokens a step,
   warps, pipeline stages, grid order, programs before splitting), searched on the first
   shape, the best few then run on every shape; each is checked against the plain-jnp
   reference (max error over the largest output) and timed as GB/s of the bytes
   attention must move (every K / V page once, q in, the output out) against the copy. JAX's shipped Pallas GPU
   ``paged_attention`` runs on the same data (a head-major copy of the cache; int8 / fp8
   with unit scales, as it takes them) at two settings, the faster reported;
3. **prefill**-shaped batches (``--prefill-shapes``: sequences x new tokens [+ context
   already cached]) at bf16: the useful causal FLOPs over the time, against the
   measured matrix rate and the datasheet's bf16 peak;
4. writes the chosen configuration per (phase, KV bytes) as a tuning file
   (``--tuning-out``; ``JAXPAGE_GPU_ATTENTION_TUNING`` makes the kernel read it, and
   ``pallas_kernels/ragged_paged_attention/gpu_tuned.json`` is where measured entries are
   committed), every measurement as JSON (``--json``) and a Markdown table on stdout.

Times are the device's throughput: ``--calls`` calls launched back to back and awaited
once (the attention call includes the XLA work around the kernel: the tile table, the
query tiles, the split merge), the median of ``--repeats`` such runs.

    python scripts/tune_gpu_attention.py --json out/tune.json --tuning-out out/gpu_tuned.json
    python scripts/tune_gpu_attention.py --quick          # a few configurations only
    python scripts/tune_gpu_attention.py --interpret --decode-shapes 2x64 \\
        --prefill-shapes 1x32 --kv-formats bfloat16 --quick   # CPU smoke test (no timing)
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import kv_quant  # noqa: E402
from pallas_kernels.ragged_paged_attention import gpu, ragged_paged_attention  # noqa: E402
from pallas_kernels.ragged_paged_attention import half_products as in_halves  # noqa: E402
from pallas_kernels.ragged_paged_attention import tiling  # noqa: E402
from pallas_kernels.ragged_paged_attention.split_merge import call_outputs  # noqa: E402
from pallas_kernels.ragged_paged_attention.gpu_config import (  # noqa: E402
    DEFAULTS, ENV_TUNING, GpuKernelConfig, choose_blocks, config_for)

HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
DATASHEET_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode-shapes", default="64x2048,8x16384,256x512",
                   help="batch x context, comma-separated; the first is searched")
    p.add_argument("--prefill-shapes", default="4x2048,8x512+1536,2x1024",
                   help="sequences x new tokens [+ context already cached]")
    p.add_argument("--kv-formats", default="bfloat16,int8,fp8_e4m3")
    p.add_argument("--budget-s", type=float, default=240.0,
                   help="stop searching new configurations after this many seconds")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=3, help="configurations run on every shape")
    p.add_argument("--quick", action="store_true", help="a few configurations only")
    p.add_argument("--no-search", action="store_true",
                   help="time the kernel's own table (gpu_tuned.json or "
                        "JAXPAGE_GPU_ATTENTION_TUNING) at every shape, with the untuned "
                        "defaults and its variants beside it; search nothing")
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--tuning-out", type=Path, default=None)
    return p.parse_args(argv)


# -- timing and ceilings ----------------------------------------------------------------

def device_seconds(fn, *, calls: int, repeats: int) -> float:
    """Seconds per call of ``fn()`` (already compiled), launched ``calls`` times back to
    back and awaited once; the median of ``repeats`` runs."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = [fn() for _ in range(calls)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def measure_ceilings(args) -> dict:
    n = (64 if args.interpret else 1024) * 2**20 // 4
    x = jnp.arange(n, dtype=jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    bandwidth = 2 * n * 4 / device_seconds(lambda: copy(x), calls=args.calls,
                                           repeats=args.repeats)
    m = 1024 if args.interpret else 8192
    a = jax.random.normal(jax.random.PRNGKey(1), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(2), (m, m), jnp.bfloat16)
    matmul = jax.jit(lambda a, b: a @ b)
    flops = 2 * m**3 / device_seconds(lambda: matmul(a, b), calls=max(3, args.calls // 4),
                                      repeats=args.repeats)
    kind = jax.devices()[0].device_kind
    peak = next((v for k, v in DATASHEET_BF16.items() if k in kind), None)
    return dict(bandwidth=bandwidth, matmul_flops=flops, datasheet_bf16=peak)


# -- batches ------------------------------------------------------------------------------

def decode_batch(batch: int, context: int, kv_format: str, seed: int = 0):
    """Random decode batch: ``batch`` sequences of ``context`` tokens, one new each, pages
    scattered over the cache. Byte formats hold random bytes of finite values."""
    h = HEADS
    pages = -(-context // h["block_size"])
    num_blocks = batch * pages + 1
    shape = (num_blocks, h["block_size"], h["num_kv_heads"], h["head_dim"])
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    if kv_format == "bfloat16":
        k = jax.random.normal(keys[0], shape, jnp.float32).astype(jnp.bfloat16)
        v = jax.random.normal(keys[1], shape, jnp.float32).astype(jnp.bfloat16)
    else:
        scale = kv_quant.MAX_VALUE[kv_format] / 4
        k = kv_quant.encode(jax.random.normal(keys[0], shape) * scale, kv_format)
        v = kv_quant.encode(jax.random.normal(keys[1], shape) * scale, kv_format)
    q = jax.random.normal(keys[2], (batch, h["num_q_heads"], h["head_dim"])).astype(jnp.bfloat16)
    rng = np.random.default_rng(seed)
    tables = (1 + rng.permutation(num_blocks - 1)).reshape(batch, pages).astype(np.int32)
    return dict(q=q, k=k, v=v, kv_lens=jnp.full((batch,), context, jnp.int32),
                tables=jnp.asarray(tables), cu=jnp.arange(batch + 1, dtype=jnp.int32),
                num_seqs=jnp.asarray([batch], jnp.int32), kv_format=kv_format)


def prefill_batch(seqs: int, new: int, cached: int, seed: int = 0):
    """``seqs`` sequences each adding ``new`` tokens after ``cached`` already cached."""
    h = HEADS
    context = new + cached
    b = decode_batch(seqs, context, "bfloat16", seed)
    q = jax.random.normal(jax.random.PRNGKey(seed + 7), (seqs * new, h["num_q_heads"],
                                                          h["head_dim"])).astype(jnp.bfloat16)
    return dict(b, q=q, cu=jnp.arange(seqs + 1, dtype=jnp.int32) * new)


def operands(b):
    return (b["q"], b["k"], b["v"], b["kv_lens"], b["tables"], b["cu"], b["num_seqs"])


def kv_format_arg(b):
    return None if b["kv_format"] == "bfloat16" else b["kv_format"]


def decode_bytes(b) -> int:
    q = b["q"]
    pages = b["tables"].size
    kv = 2 * pages * HEADS["block_size"] * HEADS["num_kv_heads"] * HEADS["head_dim"]
    return kv * b["k"].dtype.itemsize + 2 * q.size * q.dtype.itemsize + 4 * pages


def causal_flops(seqs: int, new: int, cached: int) -> float:
    """4 * Hq * D * (keys each new token attends to), summed."""
    attended = seqs * (new * cached + new * (new + 1) / 2)
    return 4 * HEADS["num_q_heads"] * HEADS["head_dim"] * attended


# -- candidates -----------------------------------------------------------------------------

# (block_kv, num_stages, heads_fastest, prefetch), most telling first: a deadline may cut
# the list (a one-minute budget searches 3-4 of them a format). The order is the H200's
# (2026-11-27, run 2): one stage won for every format (bf16 at 64 KV tokens a step, the
# byte formats at 128); pipelined stages and the register prefetch were slower, so they
# come last. Byte caches read through shared memory one byte at a time when pipelined
# (Triton's cp.async path, seen in the PTX). 256 tokens with the prefetch is left out: it
# spills (10-30 KB of spill stores a thread by ``ptxas -v``, ``kernel_ptx_ops.py``; 4.9 ms
# on the H200 against 0.14-0.2).
DECODE_TILINGS = [(128, 1, False, False), (64, 1, False, False), (256, 1, False, False),
                  (128, 1, True, False), (64, 2, False, False), (128, 2, False, False),
                  (64, 1, False, True), (128, 1, False, True), (64, 3, False, False),
                  (128, 3, False, False), (64, 4, False, False), (64, 2, True, False)]


def decode_candidates(quick: bool, kv_format: str,
                      incumbent: GpuKernelConfig | None = None) -> list[GpuKernelConfig]:
    """The tilings to search, ``incumbent`` (the committed table's entry) first, so a
    search cut short by its deadline still times what the kernel runs today."""
    # byte formats searched with their products in float16 (fewer instructions per page
    # element, and for int8 161 -> 128 registers: ``half_products.py``); ``variants``
    # times the best of them without
    base = DEFAULTS["decode"].replace(half_products=kv_format in in_halves.FORMATS or None)
    if quick:
        return [base, base.replace(block_kv=128, num_stages=1, prefetch=True)]
    head = [incumbent] if incumbent else []
    if incumbent and base.half_products and not incumbent.half_products:
        head.append(incumbent.replace(half_products=True))   # the knob's own experiment
    return head + [dataclasses.replace(base, block_kv=kv, num_stages=st, heads_fastest=hf,
                                       prefetch=pf)
                   for kv, st, hf, pf in DECODE_TILINGS]


def refine_candidates(best: GpuKernelConfig) -> list[GpuKernelConfig]:
    return [best.replace(num_warps=w, target_programs=t)
            for w, t in itertools.product((4, 8), (512, 1024, 2048))] + [
        dataclasses.replace(best, heads_fastest=not best.heads_fastest)]


# Programs the wave variant asks for: at 64 x 2,048 (512 sequence x KV-head pairs) 3 KV
# splits, 1,536 programs, 3.9 waves of 3 blocks an SM on 132 SMs (the byte formats' tuned
# tiling holds 3: ``kernel_ptx_ops.py``), where 1,024 are 2.6 waves with the last 59% full.
WAVE_TARGET = 1536


def variants(best: GpuKernelConfig, kv_format: str | None = None, *,
             decode: bool = False) -> list[GpuKernelConfig | None]:
    """The chosen tiling with q / output tiled by XLA, and with every block masked: what
    reading in place and the unmasked loop each buy, measured side by side; for byte caches also
    with the products in the other 16-bit type (float16 / bfloat16), and for decode with
    ``WAVE_TARGET`` programs and with the KV splits merged the other way (XLA's two kernels
    / the Pallas merge: ``merge_kernel`` flipped); for prefill with the tiles in the other order
    (``longest_first`` flipped). A column that does not apply is None."""
    out = [dataclasses.replace(best, direct_io=False),
           dataclasses.replace(best, mask_split=False)]
    if not decode:  # the grid's tile order: what starting the longest tiles first buys
        out.append(dataclasses.replace(best, longest_first=not best.longest_first))
    if decode:
        out.append(dataclasses.replace(best, half_products=not best.half_products)
                   if kv_format in in_halves.FORMATS else None)
        out.append(dataclasses.replace(best, target_programs=WAVE_TARGET)
                   if best.target_programs != WAVE_TARGET else None)
        out.append(dataclasses.replace(best, merge_kernel=not best.merge_kernel))
    return out


# (block_q, block_kv, warps, stages, prefetch)
PREFILL_TILINGS = [(16, 128, 4, 3, False), (32, 64, 4, 2, False), (32, 64, 8, 3, False),
                   (32, 128, 8, 3, False), (16, 128, 4, 1, True), (32, 64, 4, 1, True),
                   (64, 64, 8, 2, False), (16, 64, 4, 3, False), (32, 128, 8, 2, False),
                   (64, 64, 8, 3, False)]


def prefill_candidates(quick: bool) -> list[GpuKernelConfig]:
    base = DEFAULTS["prefill"]
    if quick:
        return [base, base.replace(block_q=32, block_kv=64, num_warps=8, num_stages=3)]
    return [base] + [dataclasses.replace(base, block_q=bq, block_kv=kv, num_warps=w,
                                         num_stages=st, prefetch=pf)
                     for bq, kv, w, st, pf in PREFILL_TILINGS]


def table_config(*, decode: bool, kv_itemsize: int,
                 kv_format: str | None = None) -> GpuKernelConfig:
    """What the kernel runs here when no knob is given: its table's entry, fitted."""
    return config_for(decode=decode, kv_itemsize=kv_itemsize, compute_itemsize=2,
                      kv_format=kv_format if kv_format in kv_quant.KV_FORMATS else None,
                      head_dim=HEADS["head_dim"], block_size=HEADS["block_size"],
                      group_padded=HEADS["num_q_heads"] // HEADS["num_kv_heads"],
                      kind=jax.devices()[0].device_kind)


def effective(configs, *, decode: bool, kv_itemsize: int) -> list[GpuKernelConfig]:
    """What the kernel runs for each (fitted to this device's shared memory), without
    repeats, in order."""
    kind = jax.devices()[0].device_kind
    out = []
    for c in configs:
        fitted = config_for(decode=decode, kv_itemsize=kv_itemsize, compute_itemsize=2,
                            head_dim=HEADS["head_dim"], block_size=HEADS["block_size"],
                            group_padded=HEADS["num_q_heads"] // HEADS["num_kv_heads"],
                            kind=kind, **c.to_json())
        if fitted not in out:
            out.append(fitted)
    return out


def around_kernel_ms(b, config: GpuKernelConfig, args) -> float:
    """The work an attention call does besides the kernel at this tiling: the tile
    table, and either the split merge and the padding rows zeroed (q and the output read
    and written in place; the merge the Pallas kernel's with ``merge_kernel``) or the
    query tiles, the merge and the outputs gathered back."""
    q = b["q"]
    num_tokens, num_q_heads, head_dim = q.shape
    seqs, max_blocks = b["tables"].shape
    hkv = HEADS["num_kv_heads"]
    bq, gp, _, splits = choose_blocks(
        num_tokens=num_tokens, max_num_seqs=seqs, group=num_q_heads // hkv,
        block_size=HEADS["block_size"], max_blocks_per_seq=max_blocks, num_kv_heads=hkv,
        block_q=config.block_q, block_kv=config.block_kv,
        target_programs=config.target_programs)
    num_tiles = tiling.num_tiles_for(num_tokens, seqs, bq)
    shape = ((splits, num_tokens * num_q_heads) if config.direct_io
             else (splits, hkv, num_tiles, bq * gp))
    acc = jnp.ones(shape + (head_dim,), jnp.float32)
    m, l = jnp.zeros(shape, jnp.float32), jnp.ones(shape, jnp.float32)

    @jax.jit
    def around(q, kv_lens, cu, num_seqs, acc, m, l):
        tiles = tiling.build_tile_table(cu, kv_lens, num_seqs, num_tokens=num_tokens,
                                        block_q=bq, num_tiles=num_tiles)
        q_tiles = (None if config.direct_io else
                   tiling.tile_queries(q, tiles, num_kv_heads=hkv, group_padded=gp, block_q=bq))
        out = call_outputs((acc, m, l) if splits > 1 else acc[0], tiles=tiles, cu_q_lens=cu,
                           num_seqs=num_seqs, num_tokens=num_tokens, q_heads=num_q_heads,
                           block_q=bq, direct=config.direct_io,
                           merge_kernel=config.merge_kernel, dtype=q.dtype,
                           interpret=args.interpret)
        return out, tiles.seq if config.direct_io else q_tiles

    ops = (q, b["kv_lens"], b["cu"], b["num_seqs"], acc, m, l)
    return 1e3 * device_seconds(lambda: around(*ops), calls=args.calls, repeats=args.repeats)


# -- runs ---------------------------------------------------------------------------------

def kernel_fn(b, config: GpuKernelConfig, interpret: bool, extra: dict | None = None):
    c = {**config.to_json(), **(extra or {})}
    run = jax.jit(lambda *a: gpu.ragged_paged_attention_gpu(
        *a, sm_scale=HEADS["head_dim"] ** -0.5, interpret=interpret,
        kv_format=kv_format_arg(b), **c))
    ops = operands(b)
    return lambda: run(*ops)


def reference_out(b):
    run = jax.jit(lambda *a: ragged_paged_attention(
        *a, sm_scale=HEADS["head_dim"] ** -0.5, backend="reference", kv_format=kv_format_arg(b)))
    return np.asarray(run(*operands(b)).astype(jnp.float32))


MAX_REL_ERR = 2e-2  # bf16 rounding lands near 5e-3; a tiling past this is wrong, not slow


def usable(row: dict) -> bool:
    """A timed row whose output matched (or was not compared): one a table may choose."""
    err = row.get("rel_err", 0.0)
    return "ms" in row and err == err and err <= MAX_REL_ERR


def try_config(b, config, want, args, moved=None, flops=None, extra=None) -> dict:
    """One configuration timed (``extra``: kernel arguments that are not tuning knobs)."""
    row = dict(config=config.to_json())
    try:
        fn = kernel_fn(b, config, args.interpret, extra)
        out = np.asarray(fn().astype(jnp.float32))
        if want is not None:  # relative to the largest output
            row["rel_err"] = (float(np.max(np.abs(out - want)) / np.max(np.abs(want)))
                              if np.isfinite(out).all() else float("nan"))
        row["ms"] = 1e3 * device_seconds(fn, calls=args.calls, repeats=args.repeats)
    except Exception as error:  # noqa: BLE001 - a configuration that fails is reported
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        return row
    if moved:
        row["gb_s"] = moved / row["ms"] * 1e-6
    if flops:
        row["tflop_s"] = flops / row["ms"] * 1e-9
    return row


def shipped_kernel(b, args) -> dict:
    """JAX's shipped Pallas GPU decode kernel on the same batch, the faster of two settings."""
    from jax.experimental.pallas.ops.gpu import paged_attention as shipped

    pages_per_seq = b["tables"].shape[1]
    k_pages = jnp.transpose(b["k"], (2, 0, 1, 3))   # [Hkv, N, B, D], outside the timing
    v_pages = jnp.transpose(b["v"], (2, 0, 1, 3))
    scales = None
    if b["kv_format"] != "bfloat16":
        dtype = kv_quant.KV_FORMATS[b["kv_format"]]
        k_pages = jax.lax.bitcast_convert_type(k_pages, dtype)
        v_pages = jax.lax.bitcast_convert_type(v_pages, dtype)
        scales = jnp.ones(k_pages.shape[:3], jnp.bfloat16)
    best = dict(error="no setting divides the pages per sequence")
    for per_block in (8, 16):
        k_splits = 16
        while k_splits > 1 and pages_per_seq % (k_splits * per_block):
            k_splits //= 2
        if pages_per_seq % (k_splits * per_block):
            continue
        scale = HEADS["head_dim"] ** -0.5
        run = jax.jit(lambda q, k, v, t, n, ks, vs, _p=per_block, _s=k_splits:
                      shipped.paged_attention(q * jnp.asarray(scale, q.dtype), k, v, t, n,
                                              ks, vs, pages_per_compute_block=_p,
                                              k_splits=_s, interpret=args.interpret))
        ops = (b["q"], k_pages, v_pages, b["tables"], b["kv_lens"], scales, scales)
        try:
            ms = 1e3 * device_seconds(lambda: run(*ops), calls=args.calls, repeats=args.repeats)
        except Exception as error:  # noqa: BLE001
            best.setdefault("errors", []).append(f"{type(error).__name__}: "
                                                 f"{str(error).splitlines()[0][:120]}")
            continue
        if "ms" not in best or ms < best["ms"]:
            best = dict(ms=ms, pages_per_compute_block=per_block, k_splits=k_splits)
    return best


def fastest_everywhere(finalists, per_shape, rate: str, default: GpuKernelConfig):
    """The finalist with the best geometric mean of ``rate`` over the shapes, among those
    that ran and matched the reference at every shape (``default`` when none did)."""
    scores = []
    for i, config in enumerate(finalists):
        rows = [s["rows"][i] for s in per_shape]
        if all(r.get(rate) and usable(r) for r in rows):
            scores.append((geomean([r[rate] for r in rows]), i))
    return finalists[max(scores)[1]] if scores else default


def geomean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else 0.0


def tune_decode(args, ceilings, shapes, kv_format, deadline) -> dict:
    batches = [decode_batch(bs, ctx, kv_format) for bs, ctx in shapes]
    wants = [reference_out(b) for b in batches]
    moved = [decode_bytes(b) for b in batches]
    searched = []
    kv_itemsize = batches[0]["k"].dtype.itemsize
    incumbent = table_config(decode=True, kv_itemsize=kv_itemsize, kv_format=kv_format)
    candidates = ([incumbent] if args.no_search
                  else decode_candidates(args.quick, kv_format, incumbent))
    for config in effective(candidates, decode=True, kv_itemsize=kv_itemsize):
        if searched and time.perf_counter() > deadline:
            break
        searched.append(try_config(batches[0], config, wants[0], args, moved[0]))
    ok = [r for r in searched if usable(r)]
    if ok and not (args.quick or args.no_search) and time.perf_counter() < deadline:
        best = GpuKernelConfig(**min(ok, key=lambda r: r["ms"])["config"])
        for config in effective(refine_candidates(best), decode=True, kv_itemsize=kv_itemsize):
            if time.perf_counter() > deadline:
                break
            if any(r["config"] == config.to_json() for r in searched):
                continue
            searched.append(try_config(batches[0], config, wants[0], args, moved[0]))
    ok = sorted((r for r in searched if usable(r)), key=lambda r: r["ms"])
    finalists = [GpuKernelConfig(**r["config"]) for r in ok[:args.top]]
    for extra in [DEFAULTS["decode"]] + (variants(finalists[0], kv_format, decode=True)
                                         if finalists else []):
        if extra is not None and extra not in finalists:
            finalists.append(extra)
    per_shape = []
    for (bs, ctx), b, want, nbytes in zip(shapes, batches, wants, moved):
        rows = [try_config(b, c, want, args, nbytes) for c in finalists]
        # int8 queries times the int8 key codes (``int8_queries``): it rounds the queries,
        # so it is timed beside the choice, never chosen by the table
        q8 = (try_config(b, finalists[0], want, args, nbytes, extra=dict(int8_queries=True))
              if kv_format == "int8" and finalists else {})
        per_shape.append(dict(batch=bs, context=ctx, bytes=nbytes, rows=rows,
                              shipped=shipped_kernel(b, args), int8_queries=q8,
                              around_ms=around_kernel_ms(b, finalists[0], args)))
    chosen = fastest_everywhere(finalists, per_shape, "gb_s", DEFAULTS["decode"])
    for s in per_shape:
        s["shipped"]["gb_s"] = (s["bytes"] / s["shipped"]["ms"] * 1e-6
                                if "ms" in s["shipped"] else None)
    return dict(kv_format=kv_format, searched=searched, per_shape=per_shape,
                chosen=chosen.to_json(), best=finalists[0].to_json(),
                bandwidth=ceilings["bandwidth"])


def tune_prefill(args, ceilings, shapes, deadline) -> dict:
    batches, flops = [], []
    for seqs, new, cached in shapes:
        batches.append(prefill_batch(seqs, new, cached))
        flops.append(causal_flops(seqs, new, cached))
    base = try_config(batches[0], DEFAULTS["prefill"], None, args, flops=flops[0])
    want = np.asarray(kernel_fn(batches[0], DEFAULTS["prefill"], args.interpret)()
                      .astype(jnp.float32)) if "ms" in base else None
    searched = [base]
    candidates = ([table_config(decode=False, kv_itemsize=2)] if args.no_search
                  else prefill_candidates(args.quick)[1:])
    for config in effective(candidates, decode=False, kv_itemsize=2):
        if config == DEFAULTS["prefill"]:
            continue
        if time.perf_counter() > deadline:
            break
        searched.append(try_config(batches[0], config, want, args, flops=flops[0]))
    ok = sorted((r for r in searched if usable(r)), key=lambda r: r["ms"])
    finalists = [GpuKernelConfig(**r["config"]) for r in ok[:max(2, args.top // 2)]]
    for extra in [DEFAULTS["prefill"]] + (variants(finalists[0]) if finalists else []):
        if extra not in finalists:
            finalists.append(extra)
    per_shape = []
    for (seqs, new, cached), b, f in zip(shapes, batches, flops):
        ref = np.asarray(kernel_fn(b, DEFAULTS["prefill"], args.interpret)().astype(jnp.float32))
        per_shape.append(dict(seqs=seqs, new=new, cached=cached, flops=f,
                              rows=[try_config(b, c, ref, args, flops=f) for c in finalists],
                              around_ms=around_kernel_ms(b, finalists[0], args)))
    chosen = fastest_everywhere(finalists, per_shape, "tflop_s", DEFAULTS["prefill"])
    return dict(searched=searched, per_shape=per_shape, chosen=chosen.to_json(),
                best=finalists[0].to_json())


# -- report -------------------------------------------------------------------------------

def _key(config) -> str:
    return json.dumps(config if isinstance(config, dict) else config.to_json(), sort_keys=True)


def _variant_rows(result, rows, *, decode: bool = False):
    """Rows of the best searched tiling's variants (q / output tiled by XLA, all masked;
    for decode also byte pages' products in the other 16-bit type and ``WAVE_TARGET`` programs),
    {} where none ran."""
    best = GpuKernelConfig(**result["best"])
    return [rows.get(_key(v), {}) if v is not None else {}
            for v in variants(best, result.get("kv_format"), decode=decode)]


def decode_table(result, ceilings) -> list[str]:
    bw = ceilings["bandwidth"]
    lines = []

    def rate(r):
        return (f"{r['gb_s']:.0f} ({100 * r['gb_s'] * 1e9 / bw:.1f}%)" if "gb_s" in r
                else str(r.get("error", "-"))[:40])

    for s in result["per_shape"]:
        rows = {_key(r["config"]): r for r in s["rows"]}
        tuned = rows.get(_key(result["chosen"]), {})
        untuned = rows.get(_key(DEFAULTS["decode"]), {})
        shipped = s["shipped"]
        cells = [result["kv_format"], f"{s['batch']} x {s['context']}", rate(tuned),
                 rate(untuned), *(rate(r) for r in _variant_rows(result, rows, decode=True)),
                 rate(s.get("int8_queries") or {}),
                 rate(shipped) if shipped.get("gb_s") else str(shipped.get("error", "-"))[:40],
                 f"{tuned['gb_s'] / shipped['gb_s']:.2f}x" if "gb_s" in tuned
                 and shipped.get("gb_s") else "-",
                 f"{tuned.get('rel_err', float('nan')):.1e}",
                 f"{s['around_ms']:.3f} of {tuned.get('ms', float('nan')):.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


DECODE_HEADER = ("| KV | batch x context | tuned GB/s (of copy) | untuned | q / out tiled by XLA "
                 "| every block masked | byte pages' products in the other 16-bit type "
                 f"| {WAVE_TARGET:,} programs | splits merged the other way (merge_kernel flipped) "
                 "| int8 queries x int8 keys (rounds q) "
                 "| JAX shipped | tuned / shipped | error (rel. to max) | ms around the kernel |"
                 "\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
PREFILL_HEADER = ("| prefill (bf16) | tuned TFLOP/s | untuned | q / out tiled by XLA | every "
                  "block masked | tiles in the other order (longest_first flipped) "
                  "| of measured matmul | of datasheet | ms around the kernel |"
                  "\n|---|---|---|---|---|---|---|---|---|")


def prefill_table(result, ceilings) -> list[str]:
    lines = []

    def rate(r):
        return f"{r['tflop_s']:.0f}" if "tflop_s" in r else str(r.get("error", "-"))[:40]

    for s in result["per_shape"]:
        rows = {_key(r["config"]): r for r in s["rows"]}
        tuned = rows.get(_key(result["chosen"]), {})
        untuned = rows.get(_key(DEFAULTS["prefill"]), {})
        shape = f"{s['seqs']} x {s['new']}" + (f" (+{s['cached']} cached)" if s["cached"] else "")
        t = tuned.get("tflop_s")
        peak = ceilings.get("datasheet_bf16")
        cells = [shape, rate(tuned), rate(untuned),
                 *(rate(r) for r in _variant_rows(result, rows)),
                 f"{100 * t * 1e12 / ceilings['matmul_flops']:.1f}%" if t else "-",
                 f"{100 * t * 1e12 / peak:.1f}%" if t and peak else "-",
                 f"{s['around_ms']:.3f} of {tuned.get('ms', float('nan')):.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def parse_shapes(text: str, prefill: bool):
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        head, _, cached = item.partition("+")
        a, b = (int(x) for x in head.split("x"))
        shapes.append((a, b, int(cached or 0)) if prefill else (a, b))
    return shapes


def main(argv=None) -> int:
    args = parse_args(argv)
    device = jax.devices()[0]
    print(f"device: {device.device_kind}, jax {jax.__version__}", flush=True)
    began = time.perf_counter()
    ceilings = measure_ceilings(args)
    print(f"copy bandwidth {ceilings['bandwidth'] / 1e9:.0f} GB/s, bf16 matmul "
          f"{ceilings['matmul_flops'] / 1e12:.0f} TFLOP/s", flush=True)
    formats = [f.strip() for f in args.kv_formats.split(",") if f.strip()]
    decode_shapes = parse_shapes(args.decode_shapes, prefill=False)
    prefill_shapes = parse_shapes(args.prefill_shapes, prefill=True)
    # the search budget: equal shares to each KV format's decode and to prefill
    shares = {f: 1.0 for f in formats}
    shares["prefill"] = 1.0
    total = sum(shares.values())
    decode_results, prefill_result, entries = [], None, []
    tuning = dict(measured=f"scripts/tune_gpu_attention.py on {device.device_kind}, "
                           f"jax {jax.__version__}, {time.strftime('%Y-%m-%d')}",
                  entries=entries)

    def save():  # after every part: a run stopped by a time limit keeps what it has
        if args.tuning_out:
            args.tuning_out.write_text(json.dumps(tuning, indent=2) + "\n")
        if args.json:
            args.json.write_text(json.dumps(dict(device=device.device_kind, jax=jax.__version__,
                                                  ceilings=ceilings, decode=decode_results,
                                                  prefill=prefill_result, tuning=tuning),
                                             indent=1, default=str))

    def decode_part(kv_format):
        deadline = time.perf_counter() + args.budget_s * shares[kv_format] / total
        result = tune_decode(args, ceilings, decode_shapes, kv_format, deadline)
        decode_results.append(result)
        kv_bytes = 2 if kv_format == "bfloat16" else 1
        if not any(e["phase"] == "decode" and e["kv_bytes"] == kv_bytes for e in entries):
            entries.append(dict(device=device.device_kind, phase="decode", kv_bytes=kv_bytes,
                                config=result["chosen"]))
        if kv_bytes == 1:  # and each byte format its own (``gpu_config.tuned``)
            entries.append(dict(device=device.device_kind, phase="decode", kv_bytes=kv_bytes,
                                kv_format=kv_format, config=result["chosen"]))
        save()
        print(f"decode {kv_format}: chosen {result['chosen']} "
              f"({len(result['searched'])} searched, {time.perf_counter() - began:.0f} s)",
              flush=True)
        print("\n".join(decode_table(result, ceilings)), flush=True)

    def prefill_part():
        nonlocal prefill_result
        deadline = time.perf_counter() + args.budget_s * shares["prefill"] / total
        prefill_result = tune_prefill(args, ceilings, prefill_shapes, deadline)
        entries.append(dict(device=device.device_kind, phase="prefill", kv_bytes=2,
                            config=prefill_result["chosen"]))
        save()
        print(f"prefill: chosen {prefill_result['chosen']} ({time.perf_counter() - began:.0f} s)",
              flush=True)
        print("\n".join(prefill_table(prefill_result, ceilings)), flush=True)

    # bf16 decode, then prefill, then the byte formats: a time limit cuts the last first
    first = [f for f in formats if f == "bfloat16"]
    for kv_format in first:
        decode_part(kv_format)
    if prefill_shapes:
        prefill_part()
    for kv_format in formats:
        if kv_format not in first:
            decode_part(kv_format)
    if args.tuning_out:
        os.environ[ENV_TUNING] = str(args.tuning_out)

    print()
    print(f"Copy bandwidth {ceilings['bandwidth'] / 1e9:.0f} GB/s; bf16 matmul "
          f"{ceilings['matmul_flops'] / 1e12:.0f} TFLOP/s"
          + (f" (datasheet {ceilings['datasheet_bf16'] / 1e12:.0f})"
             if ceilings.get("datasheet_bf16") else ""))
    print()
    print(DECODE_HEADER)
    for r in decode_results:
        print("\n".join(decode_table(r, ceilings)))
    if prefill_result:
        print()
        print(PREFILL_HEADER)
        print("\n".join(prefill_table(prefill_result, ceilings)))
    print()
    print("chosen:", json.dumps(entries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
