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

Below the counts, what bounds the kernel's occupancy on an H100: its grid and shared
memory (XLA's thunk sequence), registers and spill bytes (``ptxas -v``, where the CUDA
toolkit's ``ptxas`` is installed), the blocks an SM holds and the waves the grid takes;
then, where ``cuobjdump`` is installed too (the toolkit, or ``pip install
nvidia-cuda-cuobjdump``), the SASS opcode counts: what the GPU runs, after ptxas' fusions.
``--prefill`` compiles a prefill-shaped call (4 sequences x 2,048 new tokens) instead.

    python scripts/kernel_ptx_ops.py --kv-format fp8_e4m3 --variant half_products=true
    python scripts/kernel_ptx_ops.py --kv-format int8 --variant target_programs=1536
    python scripts/kernel_ptx_ops.py --prefill --kv-format bfloat16 \
        --base block_kv=64,num_warps=4,num_stages=2 --variant block_q=32,num_warps=8
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
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


# An H100 SM's limits (CUDA occupancy calculator, compute capability 9.0).
SMS, SM_REGISTERS, REGISTER_UNIT, SM_SHARED, BLOCK_RESERVED_SHARED = 132, 65536, 256, 233472, 1024
SM_THREADS, SM_BLOCKS = 2048, 32


def compile_and_dump(kv_format: str | None, knobs: dict, dump_dir: str, *, seqs: int = 64,
                     tokens: int = 64) -> list[str]:
    """Compile the kernel's call once for an H100 with XLA dumping to ``dump_dir`` (set
    before JAX starts): ``seqs`` sequences of 2,048 tokens' pages, ``tokens`` new tokens
    among them (``seqs`` for decode, more for a prefill-shaped call); returns the files
    that compile wrote."""
    import jax.numpy as jnp

    from jaxpage.parallel.targets import compile_on_device, target_devices
    from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu

    before = set(glob.glob(f"{dump_dir}/**/*", recursive=True))
    hq, hkv, head_dim, block, blocks, per_seq = 32, 8, 128, 16, 8192, 128
    cache = ((blocks, block, hkv, head_dim), jnp.uint8 if kv_format else jnp.bfloat16)
    specs = [((tokens, hq, head_dim), jnp.bfloat16), cache, cache, ((seqs,), jnp.int32),
             ((seqs, per_seq), jnp.int32), ((seqs + 1,), jnp.int32), ((1,), jnp.int32)]
    compile_on_device(target_devices("h100")[0], ragged_paged_attention_gpu, *specs,
                      static_kwargs=dict(sm_scale=head_dim ** -0.5, kv_format=kv_format,
                                         **knobs))
    return sorted(set(glob.glob(f"{dump_dir}/**/*", recursive=True)) - before)


def kernel_ptx(files: list[str]) -> str:
    """The attention kernel's PTX (XLA's dump holds one kernel a file)."""
    for path in files:
        if path.endswith(".ptx"):
            text = open(path).read()
            if re.search(r"\.entry\s+\w*ragged_paged_attention", text):
                return text
    raise SystemExit("no PTX of the attention kernel in the dump (XLA_FLAGS set too late?)")


def kernel_ops(ptx: str) -> collections.Counter:
    """Static counts of the kernel's PTX instructions (predicated ones included)."""
    body = ptx[re.search(r"\.entry\s+\w*ragged_paged_attention", ptx).start():]
    counts = collections.Counter()
    # Triton's inline asm puts several statements on one line: count each statement.
    for statement in re.split(r"[;\n]", body):
        match = re.match(r"\s*(?:@!?%\w+\s+)?([a-z][\w.]*)", statement)
        if match:
            counts[match.group(1)] += 1
    return counts


def launches(files: list[str]) -> list[dict]:
    """Every kernel the compiled call launches, from XLA's thunk sequence: name, grid,
    threads a block and dynamic shared memory."""
    rows = []
    for path in files:
        if path.endswith("thunk_sequence_after_thunk_passes.txt"):
            for name, grid, threads, shared in re.findall(
                    r"kCustomKernel.*?\]\s+(\S+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]"
                    r"\s+shared_memory: (\d+) bytes", open(path).read()):
                rows.append(dict(name=name, grid=[int(g) for g in grid.split(",")],
                                 threads=[int(t) for t in threads.split(",")],
                                 shared=int(shared)))
    return rows


def cuda_tool(name: str) -> str | None:
    """A CUDA toolkit program (``ptxas``, ``cuobjdump``): on the PATH, in
    ``/usr/local/cuda*/bin``, or from NVIDIA's pip wheels (``nvidia-cuda-cuobjdump``
    installs ``site-packages/nvidia/cu13/bin/cuobjdump``); None where there is none."""
    found = shutil.which(name) or next(iter(glob.glob(f"/usr/local/cuda*/bin/{name}")), None)
    if found:
        return found
    for path in sys.path:
        for candidate in glob.glob(os.path.join(path, "nvidia", "*", "bin", name)):
            if os.access(candidate, os.X_OK):
                return candidate
    return None


def sass_ops(ptx: str) -> collections.Counter | None:
    """Static counts of the kernel's SASS opcodes for sm_90a (``ptxas``, then
    ``cuobjdump -sass``), modifiers dropped (``FFMA``, ``MUFU``, ``HGMMA``); None without
    both tools. What the GPU runs: ptxas fuses, splits and drops PTX instructions (it never
    fuses a ``mul.rn`` and an ``add.rn`` into an FFMA, for one)."""
    ptxas, cuobjdump = cuda_tool("ptxas"), cuda_tool("cuobjdump")
    if ptxas is None or cuobjdump is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(ptx)
        try:
            subprocess.run([ptxas, "-arch=sm_90a", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                           capture_output=True, check=True)
            sass = subprocess.run([cuobjdump, "-sass", f"{tmp}/k.cubin"],
                                  capture_output=True, text=True, check=True).stdout
        except subprocess.CalledProcessError:  # e.g. a ptxas older than Triton's PTX
            return None
    return sass_counts(sass)


def sass_counts(sass: str) -> collections.Counter:
    """``cuobjdump -sass`` text -> opcode counts (predicated instructions included)."""
    counts = collections.Counter()
    for line in sass.splitlines():  # "/*0a10*/  @!P0 FFMA R1, R2, R3, R4 ;"
        match = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if match:
            counts[match.group(1)] += 1
    return counts


def ptxas_registers(ptx: str) -> tuple[int, int] | None:
    """(registers a thread, spill bytes stored) from ``ptxas -v`` for sm_90a, or None where
    no ptxas is installed (it ships with the CUDA toolkit) or it cannot read the PTX."""
    ptxas = cuda_tool("ptxas")
    if ptxas is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(ptx)
        try:
            out = subprocess.run([ptxas, "-arch=sm_90a", "-v", f"{tmp}/k.ptx", "-o",
                                  f"{tmp}/k.cubin"], capture_output=True, text=True,
                                 check=True).stderr
        except subprocess.CalledProcessError:  # e.g. a ptxas older than Triton's PTX
            return None
    registers = int(re.search(r"Used (\d+) registers", out).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", out).group(1))
    return registers, spills


def occupancy(threads: int, shared: int, registers: int | None) -> int:
    """Blocks of the kernel one H100 SM holds at once (registers, shared memory, threads)."""
    limits = [SM_BLOCKS, SM_THREADS // threads,
              SM_SHARED // (shared + BLOCK_RESERVED_SHARED)]
    if registers is not None:
        warp_registers = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
        limits.append(SM_REGISTERS // (warp_registers * (threads // 32)))
    return min(limits)


def resources(files: list[str], ptx: str) -> dict:
    """What bounds the kernel's occupancy, as rows of the printed table."""
    calls = launches(files)
    kernel = next(c for c in calls if c["name"].startswith("ragged_paged_attention"))
    regs = ptxas_registers(ptx)
    threads = kernel["threads"][0] * kernel["threads"][1] * kernel["threads"][2]
    programs = kernel["grid"][0] * kernel["grid"][1] * kernel["grid"][2]
    per_sm = occupancy(threads, kernel["shared"], regs[0] if regs else None)
    waves = -(-programs // (SMS * per_sm))
    return {
        "kernel": kernel["name"],
        "grid (programs)": f"{kernel['grid']} ({programs})",
        "shared memory a block (B)": kernel["shared"],
        "registers a thread (ptxas)": regs[0] if regs else "no ptxas",
        "spill stores (B)": regs[1] if regs else "no ptxas",
        "blocks an SM holds": per_sm,
        "waves over 132 SMs (last one's fill)":
            f"{waves} ({programs / (SMS * per_sm) - waves + 1:.0%})",
        "kernels the call launches": len(calls),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-format", default="fp8_e4m3",
                        help="int8, fp8_e4m3, fp8_e5m2 or bfloat16 (a float cache)")
    parser.add_argument("--base", default="block_kv=128,num_warps=4,num_stages=1",
                        help="knobs of the first compile")
    parser.add_argument("--variant", default="half_products=true",
                        help="knobs changed for the second compile")
    parser.add_argument("--prefill", action="store_true",
                        help="a prefill-shaped call (4 sequences x 2,048 new tokens) "
                             "instead of decode (64 x 1)")
    parser.add_argument("--ops", default=",".join(DEFAULT_OPS),
                        help="instruction prefixes to print (all: empty)")
    parser.add_argument("--sass-rows", type=int, default=24,
                        help="SASS opcodes to print, most frequent first (where ptxas and "
                             "cuobjdump are installed)")
    args = parser.parse_args()
    dump_dir = tempfile.mkdtemp(prefix="ptx-")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump_dir}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    kv_format = None if args.kv_format == "bfloat16" else args.kv_format
    base = parse_knobs(args.base)
    variant = {**base, **parse_knobs(args.variant)}
    counts, shapes, sass = [], [], []
    for knobs in (base, variant):
        files = compile_and_dump(kv_format, knobs, dump_dir, seqs=4 if args.prefill else 64,
                                 tokens=8192 if args.prefill else 64)
        ptx = kernel_ptx(files)
        counts.append(kernel_ops(ptx))
        shapes.append(resources(files, ptx))
        sass.append(sass_ops(ptx))
    prefixes = tuple(p for p in args.ops.split(",") if p)
    ops = sorted({op for c in counts for op in c if not prefixes or op.startswith(prefixes)},
                 key=lambda op: -max(c[op] for c in counts))
    shape = "4 x 2,048 prefill" if args.prefill else "64 x 1 decode"
    print(f"H100 PTX of ragged_paged_attention_gpu, {args.kv_format}, {shape} tokens, "
          f"Llama-3-8B heads (static counts)")
    print(f"| instruction | {args.base} | + {args.variant} |")
    print("|---|---|---|")
    for op in ops:
        print(f"| `{op}` | {counts[0][op]} | {counts[1][op]} |")
    print()
    print(f"| H100 resources | {args.base} | + {args.variant} |")
    print("|---|---|---|")
    for row in shapes[0]:
        print(f"| {row} | {shapes[0][row]} | {shapes[1][row]} |")
    if sass[0] is not None:
        print()
        print(f"| SASS (sm_90a), {sum(sass[0].values())} / {sum(sass[1].values())} "
              f"instructions | {args.base} | + {args.variant} |")
        print("|---|---|---|")
        for op in sorted(set(sass[0]) | set(sass[1]),
                         key=lambda op: -max(sass[0][op], sass[1][op]))[:args.sass_rows]:
            print(f"| `{op}` | {sass[0][op]} | {sass[1][op]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
