"""Quantized matmuls against bfloat16 at Llama-3-8B's projection shapes, on this device.

For each token count (a prefill chunk, or a decode batch) times one decoder layer's seven
projections (q, k, v, o, gate, up, down: ``[4096 -> 4096 / 1024 / 14336]`` and back) as
the engine runs them (``pallas_kernels.quantized_matmul``; W8A8 codes laid out as the
loader lays them out for the device, ``prequantized.for_device``), and prints per format
the time of the seven, the TFLOP/s, the ratio to bfloat16 and the prefill tokens/s of 32
such layers (projections only):

* ``bf16``: the dense dot (the baseline, run side by side in the same process);
* ``fp8_w8a8`` / ``int8_w8a8``: FP8 / int8 codes, per-channel scales, activations
  quantized per token (an FP8 or W8A8 checkpoint where the chip multiplies such codes;
  weight-only where it does not);
* ``fp8_weight_only``: FP8 codes, per-channel scales, activations in bf16;
* ``int8_g32`` / ``int4_g32``: jaxpage's own weight-only modes (groups of 32 rows);
  ``int4_g128``: AWQ / GPTQ's (groups of 128 rows); on a GPU or TPU these take the Pallas
  kernel that dequantizes tiles on chip, and ``X_jnp`` is the same weight through the jnp
  form (the dequantized weight materialized per call), side by side;
* ``int8_channel``: int8 codes, one scale per output channel (weight-only).

    python scripts/bench_quantized_matmul.py [--tokens 1,64,512,2048] [--json out.json]

On the CPU use ``--scale 16`` (every dimension divided by 16) for a quick run; the
numbers that matter come from a GPU or TPU (``scripts/accelerator_check.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

HIDDEN, KV, INTERMEDIATE, LAYERS = 4096, 1024, 14336, 32
FORMATS = ("bf16", "fp8_w8a8", "int8_w8a8", "fp8_weight_only", "int8_channel", "int8_g32",
           "int8_g32_jnp", "int4_g32", "int4_g32_jnp", "int4_g128", "int4_g128_jnp")


def projections(scale: int) -> list[tuple[int, int]]:
    """(in, out) of one Llama-3-8B layer's seven projections, divided by ``scale``."""
    h, kv, i = HIDDEN // scale, KV // scale, INTERMEDIATE // scale
    return [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]


def make_weight(fmt: str, k: int, n: int, rng: np.random.Generator, device) -> tuple:
    """(weight: an array or a dict of parts, activations scheme) for ``fmt``."""
    import jax.numpy as jnp

    from jaxpage.models.prequantized import for_device
    from jaxpage.models.quantize import QuantFormat, group_size_for, quantize

    w = rng.standard_normal((k, n)).astype(np.float32) * 0.02
    fmt = fmt.removesuffix("_jnp")
    if fmt == "bf16":
        return jnp.asarray(w, jnp.bfloat16), None
    if fmt in ("int8_g32", "int4_g32", "int4_g128", "int8_channel"):
        spec = {"int8_g32": QuantFormat(8, 32, zero=True), "int4_g32": QuantFormat(4, 32),
                "int4_g128": QuantFormat(4, group_size_for(k, 128)),  # K // 128 at --scale
                "int8_channel": QuantFormat(8, None)}[fmt]
        return {name: jnp.asarray(part) for name, part in quantize(w, spec).items()}, None
    codes = "fp8" if fmt.startswith("fp8") else "int"
    activations = None if fmt == "fp8_weight_only" else "dynamic"
    scale = np.abs(w).max(axis=0, keepdims=True) / (448.0 if codes == "fp8" else 127.0)
    q = w / scale
    q = (q.astype(jnp.float8_e4m3fn) if codes == "fp8"
         else np.clip(np.rint(q), -127, 127).astype(np.int8))
    fmt_spec = QuantFormat(8, None, codes, activations=activations)
    if activations is not None:
        fmt_spec = for_device({"w": fmt_spec}, device)["w"]
    parts = {"scale": jnp.asarray(scale.astype(np.float32))}
    if fmt_spec.transposed:
        parts["codes_t"] = jnp.asarray(np.ascontiguousarray(np.asarray(q).T))
    else:
        parts["codes"] = jnp.asarray(q)
    return parts, activations


def time_layer(fmt: str, tokens: int, shapes, iters: int, device) -> float:
    """Seconds per call of the seven projections in ``fmt`` at ``tokens`` rows."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.quantized_matmul import quantized_matmul

    rng = np.random.default_rng(0)
    weights = [make_weight(fmt, k, n, rng, device) for k, n in shapes]
    xs = [jnp.asarray(rng.standard_normal((tokens, k)), jnp.bfloat16) for k, _ in shapes]
    schemes = [scheme for _, scheme in weights]
    backend = "reference" if fmt.endswith("_jnp") else "auto"

    @jax.jit
    def layer(xs, ws):
        outs = []
        for x, w, scheme in zip(xs, ws, schemes):
            if isinstance(w, dict):
                outs.append(quantized_matmul(x, w, activations=scheme, backend=backend))
            else:
                outs.append(jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
        return outs

    ws = [w for w, _ in weights]
    jax.block_until_ready(layer(xs, ws))
    start = time.perf_counter()
    for _ in range(iters):
        out = layer(xs, ws)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,64,512,2048")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--scale", type=int, default=1, help="divide every dimension by this")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import jax

    device = jax.devices()[0]
    shapes = projections(args.scale)
    flops_per_token = 2 * sum(k * n for k, n in shapes)
    rows = []
    print(f"device {device.device_kind}, jax {jax.__version__}, Llama-3-8B projections / "
          f"{args.scale}, {args.iters} iterations")
    print("| tokens | format | ms per layer | TFLOP/s | vs bf16 | prefill tokens/s (32 layers) |")
    print("|---|---|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        base = None
        for fmt in args.formats.split(","):
            seconds = time_layer(fmt, tokens, shapes, args.iters, device)
            base = seconds if fmt == "bf16" else base
            ratio = "-" if base is None or fmt == "bf16" else f"{base / seconds:.2f}x"
            tflops = flops_per_token * tokens / seconds / 1e12
            rows.append(dict(tokens=tokens, format=fmt, seconds=seconds, tflops=tflops))
            print(f"| {tokens} | {fmt} | {seconds * 1e3:.3f} | {tflops:.1f} | {ratio} | "
                  f"{tokens / (seconds * LAYERS):,.0f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device.device_kind, "jax": jax.__version__,
                       "scale": args.scale, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
