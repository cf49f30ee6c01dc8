#!/usr/bin/env python3
"""Stacked layers in ``lax.scan`` against one weight array per layer in an unrolled loop.

Why ``jaxpage/models/llama.py`` unrolls its layers: XLA copies each layer's slice out of a
stacked ``[num_layers, ...]`` weight before the matmuls read it (a ``dynamic-slice``
fusion per weight, per layer, per step). This script times the decoder's seven
projections and its MLP, with random weights of a model's shapes (SmolLM2-135M by
default), both ways, side by side in one process, at several token counts, plus the
compile time of each program. Attention is left out: it is the same in both.

    python scripts/bench_layer_loop.py
    python scripts/bench_layer_loop.py --layers 30 --hidden 576 --intermediate 1536 \\
        --kv-dim 192 --tokens 1,4,16,64,512
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp


def make_weights(layers: int, hidden: int, intermediate: int, kv_dim: int):
    shapes = {"q": (hidden, hidden), "k": (hidden, kv_dim), "v": (hidden, kv_dim),
              "o": (hidden, hidden), "gate": (hidden, intermediate),
              "up": (hidden, intermediate), "down": (intermediate, hidden)}
    keys = jax.random.split(jax.random.key(0), len(shapes))
    stacked = {name: jax.random.normal(key, (layers, *shape), jnp.float32) * 0.02
               for key, (name, shape) in zip(keys, shapes.items())}
    per_layer = [{name: jnp.array(w[i]) for name, w in stacked.items()} for i in range(layers)]
    return stacked, per_layer


def layer(h, w):
    """The projections of one decoder layer; a cheap stand-in mixes q, k and v."""
    q, k, v = h @ w["q"], h @ w["k"], h @ w["v"]
    h = h + (q * jnp.tanh(k.sum(-1, keepdims=True) + v.sum(-1, keepdims=True))) @ w["o"]
    return h + (jax.nn.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"]


def scanned(h, stacked):
    return jax.lax.scan(lambda h, w: (layer(h, w), None), h, stacked)[0]


def unrolled(h, per_layer):
    for w in per_layer:
        h = layer(h, w)
    return h


def seconds_per_call(fn, *args, repeats: int) -> float:
    fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--kv-dim", type=int, default=192)
    parser.add_argument("--tokens", default="1,4,16,64,512")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    stacked, per_layer = make_weights(args.layers, args.hidden, args.intermediate, args.kv_dim)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"{args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}")
    h = jnp.ones((16, args.hidden), jnp.float32)
    for name, fn, weights in (("scan", scanned, stacked), ("unrolled", unrolled, per_layer)):
        start = time.perf_counter()   # first: nothing of this shape is compiled yet
        jax.jit(fn).lower(h, weights).compile()
        print(f"compile ({name}, 16 tokens): {time.perf_counter() - start:.2f} s")
    print("| tokens | scan over stacked (ms) | unrolled, per-layer (ms) | speed-up |")
    print("|---|---|---|---|")
    scan_fn, unrolled_fn = jax.jit(scanned), jax.jit(unrolled)
    for tokens in [int(t) for t in args.tokens.split(",")]:
        h = jnp.full((tokens, args.hidden), 0.1, jnp.float32)
        scan_s = seconds_per_call(scan_fn, h, stacked, repeats=args.repeats)
        unrolled_s = seconds_per_call(unrolled_fn, h, per_layer, repeats=args.repeats)
        print(f"| {tokens} | {scan_s * 1e3:.1f} | {unrolled_s * 1e3:.1f} | "
              f"{scan_s / unrolled_s:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
