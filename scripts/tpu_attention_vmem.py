"""VMEM the TPU attention kernel needs, as Mosaic allocates it, per shape and chip.

Compiles ``ragged_paged_attention_tpu`` for TPU targets without a TPU (libtpu) with a
deliberately tiny scoped-VMEM limit: the compiler then refuses, naming the size of the
scoped allocation it wanted ("Scoped allocation with size 4.12M"). That figure is an
upper bound on the kernel's need: besides the kernel's buffers it counts operands that
XLA:TPU places in VMEM when there is room (at the default 16 MiB limit it places fewer;
MHA float32 prefill on v5e asked for 17.5 MiB here and still compiled at the default
limit). Printed beside the kernel's own estimate (``tpu.vmem_bytes``, what
``choose_blocks`` sizes the tiling by).

    python scripts/tpu_attention_vmem.py                   # the default shape matrix
    python scripts/tpu_attention_vmem.py --targets v5e:1x1 --markdown

Needs ``jax[tpu]`` (``make install-compilers``).
"""

from __future__ import annotations

import argparse
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxpage.parallel.targets import compile_on_device, target_devices  # noqa: E402
from pallas_kernels.ragged_paged_attention import tpu  # noqa: E402

SHAPES = [  # name, Hq, Hkv, D, dtype, T, S
    ("smollm2 decode", 9, 3, 64, "bfloat16", 64, 64),
    ("smollm2 prefill", 9, 3, 64, "bfloat16", 512, 8),
    ("llama3-8b decode", 32, 8, 128, "bfloat16", 64, 64),
    ("llama3-8b prefill", 32, 8, 128, "bfloat16", 512, 8),
    ("llama3-8b tp8 decode", 4, 1, 128, "bfloat16", 64, 64),
    ("mha-32 decode f32", 32, 32, 128, "float32", 64, 64),
    ("mha-32 prefill f32", 32, 32, 128, "float32", 512, 8),
]
_SIZE = re.compile(r"Scoped allocation with size ([0-9.]+)([KMG])")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def measured_vmem(device, specs, **kwargs) -> str:
    """Mosaic's scoped VMEM allocation in MiB (from its error at a 64 KiB limit)."""
    try:
        compile_on_device(device, tpu.ragged_paged_attention_tpu, *specs,
                          static_kwargs=dict(sm_scale=0.1, vmem_limit_bytes=64 * 2**10,
                                             **kwargs))
    except Exception as error:  # noqa: BLE001 - the error carries the figure
        match = _SIZE.search(str(error))
        if match:
            return f"{float(match.group(1)) * _UNITS[match.group(2)] / 2**20:.2f}"
        return "error: " + str(error).splitlines()[0][:80]
    return "<0.06"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default="v5e:1x1,v6e:1x1")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    rows = []
    for target in args.targets.split(","):
        device = target_devices(target)[0]
        for name, hq, hkv, d, dtype_name, T, S in SHAPES:
            dtype = jnp.dtype(dtype_name)
            B, M = args.block_size, 4096 // args.block_size
            cache = ((512, B, hkv, d), dtype)
            specs = [((T, hq, d), dtype), cache, cache, ((S,), jnp.int32), ((S, M), jnp.int32),
                     ((S + 1,), jnp.int32), ((1,), jnp.int32)]
            bq, gp, pages = tpu.choose_blocks(num_tokens=T, max_num_seqs=S, group=hq // hkv,
                                              block_size=B, max_blocks_per_seq=M,
                                              num_kv_heads=hkv, head_dim=d,
                                              itemsize=dtype.itemsize)
            estimate = tpu.vmem_bytes(num_kv_heads=hkv, head_dim=d, rows=bq * gp,
                                      block_kv=pages * B, itemsize=dtype.itemsize)
            rows.append((target, name, f"{bq * gp}", f"{pages * B}",
                         f"{estimate / 2**20:.2f}", measured_vmem(device, specs)))
            print(*rows[-1], sep="  |  ", flush=True)
    header = ("target", "shape", "q rows", "kv tokens/step", "estimate MiB", "Mosaic MiB")
    if args.markdown:
        print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
