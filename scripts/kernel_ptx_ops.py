#!/usr/bin/env python3
"""What the GPU attention kernel compiles to, without a GPU: PTX instruction counts.

Compiles ``ragged_paged_attention_gpu`` for an H100 (deviceless: ``jaxpage.parallel.targets``)
at Llama-3-8B's decode shape (64 sequences, 32 query / 8 KV heads, head_dim 128, block 16)
twice: with the knobs of ``--base`` and with those of ``--variant``
(``gpu_config.GpuKernelConfig`` fields, ``name=value`` separated by commas), and prints
the kernel's instruction counts side by side (static counts over the kernel's whole
body, which its loop dominates; ``--ops`` picks the rows). Counts are not timings: they
show what a change does to the code (conversions, shared-memory traffic, barriers), and a
lent GPU says what that is worth (``scripts/tune_gpu_attention.py``).

    python scripts/kernel_ptx_ops.py --kv-format fp8_e4m3 --variant half_products=true
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEFAULT_OPS = ("cvt", "prmt", "mma", "ldmatrix", "ld.shared", "st.shared", "bar.sync",
               "sub.", "add.rn.f16", "ex2")


def parse_knobs(text: str) -> dict:
    knobs = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        knobs[name] = {"true": True, "false": False}.get(value.lower(), value)
        if isinstance(knobs[name], str):
            knobs[name] = int(value)
    return knobs


def kernel_ops(kv_format: str | None, knobs: dict, dump_dir: str) -> collections.Counter:
    """Compile once with XLA dumping to ``dump_dir`` (set before JAX starts) and count the
    attention kernel's PTX instructions (predicated ones included)."""
    import jax.numpy as jnp

    from jaxpage.parallel.targets import compile_on_device, target_devices
    from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu

    before = set(glob.glob(f"{dump_dir}/**/*.ptx", recursive=True))
    seqs, hq, hkv, head_dim, block, blocks, per_seq = 64, 32, 8, 128, 16, 8192, 128
    cache = ((blocks, block, hkv, head_dim), jnp.uint8 if kv_format else jnp.bfloat16)
    specs = [((seqs, hq, head_dim), jnp.bfloat16), cache, cache, ((seqs,), jnp.int32),
             ((seqs, per_seq), jnp.int32), ((seqs + 1,), jnp.int32), ((1,), jnp.int32)]
    compile_on_device(target_devices("h100")[0], ragged_paged_attention_gpu, *specs,
                      static_kwargs=dict(sm_scale=head_dim ** -0.5, kv_format=kv_format,
                                         **knobs))
    counts = collections.Counter()
    for path in set(glob.glob(f"{dump_dir}/**/*.ptx", recursive=True)) - before:
        text = open(path).read()
        entry = re.search(r"\.entry\s+\w*ragged_paged_attention\w*", text)
        if entry is None:
            continue
        body = text[entry.start():]   # one kernel a file (XLA's dump); inline asm braces
        for op in re.findall(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.]*)", body, re.M):
            counts[op] += 1
    if not counts:
        raise SystemExit("no PTX of the attention kernel in the dump (XLA_FLAGS set too late?)")
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-format", default="fp8_e4m3",
                        help="int8, fp8_e4m3, fp8_e5m2 or bfloat16 (a float cache)")
    parser.add_argument("--base", default="block_kv=128,num_warps=4,num_stages=1",
                        help="knobs of the first compile")
    parser.add_argument("--variant", default="half_products=true",
                        help="knobs changed for the second compile")
    parser.add_argument("--ops", default=",".join(DEFAULT_OPS),
                        help="instruction prefixes to print (all: empty)")
    args = parser.parse_args()
    dump_dir = tempfile.mkdtemp(prefix="ptx-")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump_dir}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    kv_format = None if args.kv_format == "bfloat16" else args.kv_format
    base = parse_knobs(args.base)
    variant = {**base, **parse_knobs(args.variant)}
    counts = [kernel_ops(kv_format, base, dump_dir), kernel_ops(kv_format, variant, dump_dir)]
    prefixes = tuple(p for p in args.ops.split(",") if p)
    ops = sorted({op for c in counts for op in c if not prefixes or op.startswith(prefixes)},
                 key=lambda op: -max(c[op] for c in counts))
    print(f"H100 PTX of ragged_paged_attention_gpu, {args.kv_format}, 64 x 1 decode tokens, "
          f"Llama-3-8B heads (static counts)")
    print(f"| instruction | {args.base} | + {args.variant} |")
    print("|---|---|---|")
    for op in ops:
        print(f"| `{op}` | {counts[0][op]} | {counts[1][op]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
