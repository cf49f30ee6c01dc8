#!/usr/bin/env python3
"""Time the ragged paged attention backends against the bytes they must move.

For one batch shape (default: decode, batch 64, context 2048, Llama-3-8B heads: 32 query
heads, 8 kv heads, head_dim 128, bfloat16, block size 16) it times every backend that can
run on the device at hand, divides the bytes attention must read and write (the K/V pages
of every sequence, the queries and the output) by the time, and reports that as a
fraction of the device's memory bandwidth measured here with a large copy. On a GPU the
table also holds JAX's shipped Pallas GPU ``paged_attention`` (decode only) on the same
data, re-laid out to the head-major cache it expects.

    python scripts/bench_kernels.py                          # defaults, on a GPU / TPU
    python scripts/bench_kernels.py --batch 4 --context 256  # small, runs on a CPU
    python scripts/bench_kernels.py --interpret --batch 2 --context 64 --iters 1
                                      # CPU: run the Pallas kernels in interpret mode
                                      # (a correctness smoke test; its times mean nothing)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.ragged_paged_attention import ragged_paged_attention  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64, help="sequences in the batch")
    p.add_argument("--context", type=int, default=2048, help="kv tokens per sequence")
    p.add_argument("--q-len", type=int, default=1,
                   help="new tokens per sequence (1 = decode; > 1 = prefill chunks)")
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--sliding-window", type=int, default=None)
    p.add_argument("--soft-cap", type=float, default=None)
    p.add_argument("--iters", type=int, default=20, help="timed calls per backend")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--backends", default=None,
                   help="comma list from reference,gpu,tpu,jax_paged_attention "
                        "(default: all that run on this device)")
    p.add_argument("--interpret", action="store_true",
                   help="run the Pallas kernels in interpret mode (CPU smoke test)")
    p.add_argument("--copy-mib", type=int, default=None,
                   help="size of the bandwidth-probe copy (default 1024 on GPU/TPU, 256 on CPU)")
    p.add_argument("--evict-mib", type=int, default=0,
                   help="CPU: before each timed call, write this many MiB of host memory so "
                        "that the pages come from memory, as between a model's layers "
                        "(0: off; the batch's pages may stay in the CPU's caches)")
    p.add_argument("--extra-blocks", type=int, default=0,
                   help="unused blocks in the cache beside the batch's, so that its pages lie "
                        "scattered through a cache of realistic size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    return p.parse_args(argv)


def timed(fn, *args, iters: int, warmup: int, before=None, repeats: int = 3) -> float:
    """Seconds per call of an already-jitted ``fn``: ``iters`` calls launched back to back
    and awaited once, the median of ``repeats`` such runs (the device's throughput, as
    ``scripts/tune_gpu_attention.py`` times it; awaiting every call would add the host's
    round trip to each). With ``before`` (run ahead of each call, untimed: the CPU's cache
    eviction) every call is awaited and timed alone, the median taken."""
    for _ in range(max(1, warmup)):
        jax.block_until_ready(fn(*args))
    times = []
    if before is None:
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready([fn(*args) for _ in range(iters)])
            times.append((time.perf_counter() - start) / iters)
        return statistics.median(times)
    for _ in range(iters):
        before()
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_bandwidth(mib: int, iters: int) -> float:
    """Bytes/s of a large elementwise copy (read once + write once)."""
    n = mib * 1024 * 1024 // 4
    x = jnp.arange(n, dtype=jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    seconds = timed(copy, x, iters=max(3, iters), warmup=2)
    return 2 * n * 4 / seconds


def make_batch(args, dtype):
    rng = np.random.default_rng(args.seed)
    pages_per_seq = -(-args.context // args.block_size)
    num_blocks = args.batch * pages_per_seq + 1 + args.extra_blocks  # block 0: the null block
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    key_k, key_v, key_q = jax.random.split(jax.random.PRNGKey(args.seed), 3)
    k_cache = jax.random.normal(key_k, shape, jnp.float32).astype(dtype)
    v_cache = jax.random.normal(key_v, shape, jnp.float32).astype(dtype)
    num_tokens = args.batch * args.q_len
    q = jax.random.normal(key_q, (num_tokens, args.num_q_heads, args.head_dim),
                          jnp.float32).astype(dtype)
    tables = (1 + rng.permutation(num_blocks - 1)[:args.batch * pages_per_seq]).reshape(
        args.batch, pages_per_seq)
    kv_lens = np.full(args.batch, args.context, np.int32)
    cu_q_lens = np.arange(args.batch + 1, dtype=np.int32) * args.q_len
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, kv_lens=jnp.asarray(kv_lens),
                block_tables=jnp.asarray(tables.astype(np.int32)),
                cu_q_lens=jnp.asarray(cu_q_lens),
                num_seqs=jnp.asarray([args.batch], jnp.int32))


def bytes_moved(args, itemsize: int) -> int:
    """What attention must move: every sequence's K and V pages once, q in, out back."""
    pages = -(-args.context // args.block_size)
    kv = 2 * args.batch * pages * args.block_size * args.num_kv_heads * args.head_dim * itemsize
    qo = 2 * args.batch * args.q_len * args.num_q_heads * args.head_dim * itemsize
    tables = args.batch * pages * 4
    return kv + qo + tables


def jax_paged_attention_fn(batch, args, interpret: bool):
    """JAX's shipped Pallas GPU decode kernel on the same data (head-major cache)."""
    from jax.experimental.pallas.ops.gpu import paged_attention as shipped

    pages_per_seq = batch["block_tables"].shape[1]
    pages_per_block = min(8, pages_per_seq)
    k_splits = 16
    while pages_per_seq % (k_splits * pages_per_block) and k_splits > 1:
        k_splits //= 2
    if pages_per_seq % (k_splits * pages_per_block):
        return None, f"needs pages per sequence ({pages_per_seq}) divisible by 8"
    k_pages = jnp.transpose(batch["k_cache"], (2, 0, 1, 3))  # [Hkv, N, B, D], outside timing
    v_pages = jnp.transpose(batch["v_cache"], (2, 0, 1, 3))
    scale = args.head_dim ** -0.5

    @jax.jit
    def run(q, k_pages, v_pages, tables, lens):
        return shipped.paged_attention(q * jnp.asarray(scale, q.dtype), k_pages, v_pages,
                                       tables, lens, pages_per_compute_block=pages_per_block,
                                       k_splits=k_splits, interpret=interpret,
                                       attn_logits_soft_cap=args.soft_cap)

    operands = (batch["q"], k_pages, v_pages, batch["block_tables"], batch["kv_lens"])
    return (lambda: run(*operands)), None


def main(argv=None) -> int:
    args = parse_args(argv)
    platform = jax.default_backend()
    device = jax.devices()[0]
    dtype = jnp.dtype(args.dtype)
    print(f"device: {device.device_kind} ({platform}), jax {jax.__version__}")
    print(f"shape: batch {args.batch}, context {args.context}, q_len {args.q_len}, "
          f"{args.num_q_heads} q heads / {args.num_kv_heads} kv heads, head_dim "
          f"{args.head_dim}, block {args.block_size}, {args.dtype}"
          + (f", sliding window {args.sliding_window}" if args.sliding_window else "")
          + (f", soft cap {args.soft_cap}" if args.soft_cap else "")
          + (f", {args.extra_blocks} more blocks in the cache" if args.extra_blocks else "")
          + (f", caches evicted before each call ({args.evict_mib} MiB written)"
             if args.evict_mib else ""))

    if args.backends:
        wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    else:
        wanted = ["reference"]
        if platform == "cpu" and args.dtype == "float32":
            wanted += ["cpu"]  # the C++ FFI kernel
        if platform == "gpu" or args.interpret:
            wanted += ["gpu", "jax_paged_attention"]
        if platform == "tpu" or args.interpret:
            wanted += ["tpu"]
    if platform == "cpu" and not args.interpret:
        print("note: the compiled Pallas kernels need a GPU or a TPU; on this CPU the "
              "reference and the C++ kernel (float32) are timed (--interpret runs the Pallas "
              "kernels in interpret mode, as a correctness smoke test whose times mean nothing)")
    if args.interpret:
        print("note: --interpret: Pallas kernels run in interpret mode; their times are "
              "not kernel performance")

    copy_mib = args.copy_mib or (256 if platform == "cpu" else 1024)
    bandwidth = measure_bandwidth(copy_mib, args.iters)
    print(f"measured memory bandwidth: {bandwidth / 1e9:.1f} GB/s "
          f"({copy_mib} MiB elementwise copy, read + write)")

    batch = make_batch(args, dtype)
    evict = None
    if args.evict_mib:
        junk = np.zeros(args.evict_mib * 2**20 // 4, np.float32)

        def evict() -> None:
            junk[:] += 1.0  # every line written: the caches now hold this, not the pages
    moved = bytes_moved(args, dtype.itemsize)
    kw = dict(sm_scale=args.head_dim ** -0.5, sliding_window=args.sliding_window,
              soft_cap=args.soft_cap)
    operands = tuple(batch[k] for k in ("q", "k_cache", "v_cache", "kv_lens", "block_tables",
                                        "cu_q_lens", "num_seqs"))
    reference = jax.jit(lambda *a: ragged_paged_attention(*a, backend="reference", **kw))
    want = np.asarray(reference(*operands).astype(jnp.float32))

    rows = []
    for name in wanted:
        note = ""
        if name == "jax_paged_attention":
            if args.q_len != 1 or args.sliding_window:
                rows.append(dict(backend=name, note="decode only, no sliding window"))
                continue
            fn, why = jax_paged_attention_fn(batch, args, interpret=platform != "gpu")
            if fn is None:
                rows.append(dict(backend=name, note=why))
                continue
            call = fn
        elif name in ("reference", "cpu", "gpu", "tpu"):
            interpret = args.interpret and name in ("gpu", "tpu")
            if name != "reference" and not interpret and platform != name:
                rows.append(dict(backend=name, note=f"needs a {name.upper()}"))
                continue
            run = jax.jit(lambda *a, _n=name, _i=interpret: ragged_paged_attention(
                *a, backend=_n, interpret=_i, **kw))
            call = (lambda _run=run: _run(*operands))
        else:
            raise SystemExit(f"unknown backend {name!r}")
        try:
            out = np.asarray(call().astype(jnp.float32))
            seconds = timed(call, iters=args.iters, warmup=args.warmup, before=evict)
        except Exception as error:  # noqa: BLE001 - report and go on with the others
            rows.append(dict(backend=name, note=f"failed: {type(error).__name__}: "
                                                f"{str(error).splitlines()[0][:120]}"))
            continue
        err = float(np.max(np.abs(out - want))) if np.isfinite(out).all() else float("nan")
        rows.append(dict(backend=name, ms=seconds * 1e3, gb_s=moved / seconds / 1e9,
                         fraction=moved / seconds / bandwidth, max_abs_err=err,
                         note=note or ("interpret mode" if args.interpret and name != "reference"
                                       else "")))

    print(f"bytes attention must move: {moved / 1e6:.1f} MB")
    header = ["backend", "time (ms)", "GB/s", "of bandwidth", "max abs err vs reference", "note"]
    lines = []
    for row in rows:
        if "ms" in row:
            lines.append([row["backend"], f"{row['ms']:.3f}", f"{row['gb_s']:.1f}",
                          f"{100 * row['fraction']:.1f}%", f"{row['max_abs_err']:.2e}",
                          row["note"]])
        else:
            lines.append([row["backend"], "-", "-", "-", "-", row["note"]])
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for line in lines:
            print("| " + " | ".join(line) + " |")
    else:
        widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
        print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
        for line in lines:
            print("  ".join(c.ljust(w) for c, w in zip(line, widths)))
    if args.json:
        args.json.write_text(json.dumps(dict(
            device=device.device_kind, platform=platform, jax=jax.__version__,
            shape={k: v for k, v in vars(args).items() if k not in ("json",)},
            bandwidth_bytes_per_s=bandwidth, bytes_moved=moved, rows=rows), indent=2,
            default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
