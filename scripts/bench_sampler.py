"""The device sampler's cost per step on this machine, by kind of request.

Sampling with a temperature but no top-k / top-p (vLLM's defaults) skips the top-k /
top-p cut, which takes passes over the whole vocabulary; this times both side by side,
with greedy beside them, at the tiny preset's and SmolLM2's shapes (rows x vocabulary).
Then the cut alone by each method (``jaxpage.runtime.cut_threshold``: a sort, or a
bisection over the float keys) on top-p rows, and the ratio sort / bisection.

    python scripts/bench_sampler.py
    python scripts/bench_sampler.py --shapes 48x49152 --repeats 10
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def batch_for(rows: int, temperature: float, top_p: float):
    import jax.numpy as jnp

    from jaxpage.runtime.step_batch import StepBatch

    return StepBatch.of_rows(
        sample_index=jnp.zeros(rows, jnp.int32), min_tokens=jnp.zeros(rows, jnp.int32),
        stop_token_ids=jnp.full((rows, 16), -1, jnp.int32),
        penalty_slot=jnp.full(rows, -1, jnp.int32),
        temperature=jnp.full(rows, temperature, jnp.float32),
        top_k=jnp.zeros(rows, jnp.int32), top_p=jnp.full(rows, top_p, jnp.float32),
        min_p=jnp.zeros(rows, jnp.float32), sample_seeds=jnp.arange(rows, dtype=jnp.uint32))


def time_ms(fn, *args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="256x4096,48x49152",
                        help="rows x vocabulary, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    import jax
    import numpy as np

    from jaxpage.runtime.cut_threshold import METHODS, cut_method, cut_threshold
    from jaxpage.runtime.sampler import sample

    run = jax.jit(sample)
    print(f"platform {jax.default_backend()}: the sampler cuts by {cut_method()}\n")
    rows_out = []
    print("| rows x vocab | greedy ms | temperature 1 ms | temperature 1, top_p 0.95 ms "
          "(cuts) | cut / no cut |")
    print("|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        rows, vocab = (int(v) for v in shape.split("x"))
        logits = jax.numpy.asarray(np.random.default_rng(0).standard_normal((rows, vocab),
                                                                            np.float32))
        row = {"rows": rows, "vocab": vocab}
        for name, temperature, top_p in (("greedy", 0.0, 1.0), ("temperature", 1.0, 1.0),
                                         ("top_p", 1.0, 0.95)):
            row[name] = time_ms(run, logits, batch_for(rows, temperature, top_p),
                                repeats=args.repeats)
        rows_out.append(row)
        print(f"| {rows} x {vocab} | {row['greedy']:.1f} | {row['temperature']:.1f} | "
              f"{row['top_p']:.1f} | {row['top_p'] / row['temperature']:.1f}x |", flush=True)
    print("\n| rows x vocab | cut by sort ms | cut by bisection ms | sort / bisection |")
    print("|---|---|---|---|")
    for row in rows_out:
        rows, vocab = row["rows"], row["vocab"]
        logits = jax.numpy.asarray(np.random.default_rng(0).standard_normal((rows, vocab),
                                                                            np.float32))
        inputs = (logits, jax.numpy.ones(rows), jax.numpy.zeros(rows, "int32"),
                  jax.numpy.full(rows, 0.95))
        for method in METHODS:
            cut = jax.jit(lambda *a, method=method: cut_threshold(*a, method=method))
            row[f"cut_{method}"] = time_ms(cut, *inputs, repeats=args.repeats)
        print(f"| {rows} x {vocab} | {row['cut_sort']:.1f} | {row['cut_bisect']:.1f} | "
              f"{row['cut_sort'] / row['cut_bisect']:.1f}x |", flush=True)
    return rows_out


if __name__ == "__main__":
    main()
