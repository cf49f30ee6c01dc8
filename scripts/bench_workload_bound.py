"""The fastest any engine could run a workload on this machine: a lower bound on its wall
time from the matmul work it must do and the weights every decode step must read.

Both rates are measured here, in this process:

* ``peak_flops``: float32 matmuls at the model's own shapes (the fused projections of one
  layer, 512 rows), through XLA:CPU, the best of a few runs;
* ``bandwidth``: bytes/s of a single-row pass over the model's weights (a matrix-vector
  product per projection, every layer), the memory-bound case of a one-sequence decode.

The workload's requests are all admitted at once (at most ``--max-num-seqs``), prompts
first, then decode steps of the rows still generating (``n_t`` at step ``t``). Then:

    prefill_s >= prompt_tokens * layer_flops_per_token / peak_flops
    step_t    >= max(n_t * (layer + lm_head flops per token) / peak_flops,
                     weight_bytes / bandwidth)

Attention, sampling, norms and the host are left out, so the bound is optimistic; an
engine's measured rate divided by ``bound_output_tokens_per_s`` is the fraction of the
machine it reaches.

    python scripts/bench_workload_bound.py --model smollm2 --workload prefill-heavy \\
        --compare '{"jaxpage": 126.6, "vllm 0.32.0": 99.5}'
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench_common import make_workload  # noqa: E402
from bench_vs_vllm import prepare_model, vocab_of  # noqa: E402


def model_shapes(model_dir: str) -> dict[str, int]:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return {"hidden": config["hidden_size"], "intermediate": config["intermediate_size"],
            "q": heads * head_dim,
            "kv": config.get("num_key_value_heads", heads) * head_dim,
            "layers": config["num_hidden_layers"], "vocab": config["vocab_size"]}


def layer_matrices(m: dict[str, int]) -> list[tuple[int, int]]:
    """(in, out) of one layer's projections, fused as engines run them."""
    h = m["hidden"]
    return [(h, m["q"] + 2 * m["kv"]), (m["q"], h), (h, 2 * m["intermediate"]),
            (m["intermediate"], h)]


def _best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_rates(m: dict[str, int], rows: int = 512, repeats: int = 5) -> tuple[float, float]:
    """(peak float32 matmul FLOP/s at ``rows`` rows, weight-read bytes/s at one row)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    weights = [[jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02)
                for shape in layer_matrices(m)] for _ in range(m["layers"])]

    @jax.jit
    def forward(ws, x):
        for qkv, o, gate_up, down in ws:
            x = x + (x @ qkv)[:, :m["q"]] @ o
            x = x + (x @ gate_up)[:, :m["intermediate"]] @ down
        return x

    def run(x):
        return lambda: forward(weights, x).block_until_ready()

    flops = 2 * rows * m["layers"] * sum(a * b for a, b in layer_matrices(m))
    many = jnp.asarray(rng.standard_normal((rows, m["hidden"]), np.float32))
    peak = flops / _best_time(run(many), repeats)
    one = jnp.asarray(rng.standard_normal((1, m["hidden"]), np.float32))
    weight_bytes = 4 * m["layers"] * sum(a * b for a, b in layer_matrices(m))
    bandwidth = weight_bytes / _best_time(run(one), repeats)
    return peak, bandwidth


def bound(m: dict[str, int], prompt_lens: list[int], output_lens: list[int], max_num_seqs: int,
          peak: float, bandwidth: float) -> dict[str, float]:
    """Lower bounds (seconds) of the workload's prefill and decode, and the output rate."""
    layer = 2 * m["layers"] * sum(a * b for a, b in layer_matrices(m))   # FLOPs per token
    head = 2 * m["hidden"] * m["vocab"]                                 # per sampled token
    weight_bytes = 4 * (layer // 2 + m["hidden"] * m["vocab"])
    prefill_s = (sum(prompt_lens) * layer + len(prompt_lens) * head) / peak
    decode_s = 0.0
    outputs = np.asarray(output_lens)
    for first in range(0, len(outputs), max_num_seqs):   # waves of admitted requests
        wave = outputs[first:first + max_num_seqs]
        for t in range(1, int(wave.max())):              # the first token came with prefill
            live = int((wave > t).sum())
            decode_s += max(live * (layer + head) / peak, weight_bytes / bandwidth)
    total = prefill_s + decode_s
    return {"prefill_s": prefill_s, "decode_s": decode_s, "bound_wall_s": total,
            "bound_output_tokens_per_s": float(outputs.sum()) / total}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--workload", default="prefill-heavy")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--compare", default="{}",
                        help="JSON {system: measured output tok/s} to put against the bound")
    args = parser.parse_args(argv)
    model_dir = prepare_model(args.model)
    shapes = model_shapes(model_dir)
    workload = make_workload(args.workload, vocab_of(model_dir))
    prompts = [len(r.prompt_token_ids) for r in workload.requests]
    outputs = [r.output_len for r in workload.requests]
    peak, bandwidth = measure_rates(shapes)
    result = {"peak_gflops": peak / 1e9, "weight_read_gbs": bandwidth / 1e9,
              **bound(shapes, prompts, outputs, args.max_num_seqs, peak, bandwidth)}
    print(f"{args.workload} on {args.model}: {len(prompts)} requests, {sum(prompts)} prompt "
          f"and {sum(outputs)} output tokens")
    print(f"measured: {result['peak_gflops']:.0f} GFLOP/s float32 matmuls, "
          f"{result['weight_read_gbs']:.1f} GB/s reading weights at one row")
    print(f"bound: prefill >= {result['prefill_s']:.1f} s, decode >= {result['decode_s']:.1f} s, "
          f"at most {result['bound_output_tokens_per_s']:.0f} output tok/s")
    for system, rate in json.loads(args.compare).items():
        print(f"  {system}: {rate:.1f} tok/s = {rate / result['bound_output_tokens_per_s']:.0%} "
              "of the bound")
    return result


if __name__ == "__main__":
    main()
