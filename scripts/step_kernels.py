"""How many kernels one decode step launches on a target, compiled without the hardware.

At batch 1 a GPU decode step is the weights' read plus every kernel's fixed cost (its
launch and tail: a few microseconds each), so the launches per layer bound how close the
step can come to the weights floor (issue [18]: 1.35x measured on an H200). This compiles
the engine's multi-step decode program for ``--target`` (``jaxpage plan``'s abstract
engine, ``--layers`` layers of ``--model``) and counts the kernels in the decode loop's
body: fusions, custom calls (the Pallas attention, cuBLAS) and the copies, collectives and
scatters left unfused; divided by the layers, with the first layer's sequence printed.

    python scripts/step_kernels.py [--model preset:llama3-8b] [--target h100] [--layers 4]

A count, not a timing: the deviceless compiler does not autotune, so GEMM splits (a
split-K GEMM is two kernels) may differ on the device.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# top-level instructions of a GPU program that each run as one kernel (or library call)
LAUNCHING = ("fusion", "custom-call", "copy", "all-reduce", "all-gather", "reduce-scatter",
             "scatter", "gather", "sort", "dynamic-update-slice")
# "  %name = shape opcode(" where a shape is one array or a tuple of them
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = (?:\([^()]*\)|\S+) ([\w-]+)\(")


def computations(hlo_text: str) -> dict[str, list[tuple[str, str]]]:
    """An HLO module's text -> {computation name: [(instruction name, opcode), ...]}."""
    result: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if header and not line.startswith(" "):
            current = result.setdefault(header.group(1), [])
            continue
        match = _INSTRUCTION.match(line)
        if match and current is not None:
            current.append((match.group(1), match.group(2)))
    return result


def loop_bodies(hlo_text: str) -> list[str]:
    """The names of the computations that are a while loop's body."""
    return re.findall(r"while\(.*?body=%?([\w.\-]+)", hlo_text)


def launches(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The instructions of a computation that launch a kernel."""
    return [(name, op) for name, op in instructions if op in LAUNCHING]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="preset:llama3-8b")
    p.add_argument("--target", default="h100")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-dtype", default="auto")
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxpage.config import EngineConfig
    from jaxpage.parallel.targets import target_devices
    from jaxpage.planning.abstract_engine import AbstractEngine

    config = EngineConfig.from_kwargs(
        model=args.model, hf_overrides={"num_hidden_layers": args.layers},
        max_num_seqs=args.max_num_seqs, max_model_len=2048, num_scheduler_steps=8,
        kv_cache_dtype=args.kv_cache_dtype)
    engine = AbstractEngine(config, target_devices(args.target), num_kv_blocks=1024)
    shape = engine.builder.decode_shapes()[0]                   # the smallest decode bucket
    program = engine.decode_program(shape)
    text = engine.compile(program).as_text()
    comps = computations(text)
    bodies = [b for b in loop_bodies(text) if b in comps]
    body = max(bodies, key=lambda b: len(launches(comps[b])), default=None)
    if body is None:
        print("no decode loop found in the compiled program")
        return 1
    kernels = launches(comps[body])
    kinds = collections.Counter(op for _, op in kernels)
    print(f"{args.model}, {args.layers} layers, {args.target}: decode bucket {list(shape)}, "
          f"{len(kernels)} kernels a step ({len(kernels) / args.layers:.1f} a layer, the "
          f"step's own work included): {dict(kinds)}")
    layer = one_layer(kernels)
    print(f"one layer's kernels, attention call to attention call ({len(layer)}):")
    for name, op in layer:
        print(f"  {op:14s} {name}")
    return 0


def one_layer(kernels: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The kernels from one attention call up to the next (a layer's, give or take where
    the cut falls): the second such stretch when there are three calls or more."""
    calls = [i for i, (name, op) in enumerate(kernels)
             if op == "custom-call" and ("pallas" in name or "attention" in name)]
    if len(calls) < 2:
        return []
    first = 1 if len(calls) >= 3 else 0
    return kernels[calls[first]:calls[first + 1]]


if __name__ == "__main__":
    sys.exit(main())
