#!/usr/bin/env python3
"""Offline throughput of jaxpage, comparing engine configurations side by side in one run.

Each configuration (``num_scheduler_steps``, the decode iterations run on the device per
call, with ``sync`` appended to turn asynchronous scheduling off) serves the same
workload of random token-id prompts with ``ignore_eos`` so every configuration produces
the same number of tokens. The workload runs once untimed (compiling every shape it
needs), then timed.

With ``--profile`` it also reports, per configuration, the host's own time per engine
step, the time ``step`` spent waiting for results, and the fraction of wall time the
device sat idle with no call dispatched (``LLMEngine.step_profile["idle_s"]``, an upper
bound: when results arrive unobserved, idleness is counted from the last time the host
looked).

    python scripts/bench_throughput.py --model preset:tiny-llama --steps 1,8sync,8 --profile
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpage import LLM, SamplingParams  # noqa: E402


def workload(args, vocab_size: int) -> list[dict]:
    rng = np.random.default_rng(args.seed)
    return [{"prompt_token_ids": rng.integers(10, vocab_size - 1, args.input_len).tolist()}
            for _ in range(args.num_requests)]


def measure(args, config: str) -> dict:
    """One engine configuration: "K" (num_scheduler_steps, asynchronous) or "Ksync"."""
    num_steps = int(config.removesuffix("sync"))
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.input_len + args.output_len + 16,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              num_scheduler_steps=num_steps, enable_prefix_caching=False,
              async_scheduling=not config.endswith("sync"))
    engine = llm.llm_engine
    prompts = workload(args, engine.arch.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # compile every shape this workload needs
    engine.step_profile.update(calls=0, device_s=0.0, host_s=0.0, idle_s=0.0, chained=0)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    wall = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    profile = engine.step_profile
    result = {"config": config, "wall_s": wall,
              "requests_per_s": len(outs) / wall, "output_tokens_per_s": out_tokens / wall,
              "total_tokens_per_s": (out_tokens + args.input_len * len(outs)) / wall}
    if args.profile:
        calls = max(profile["calls"], 1)
        result.update(engine_calls=profile["calls"], chained_calls=profile["chained"],
                      host_ms_per_call=1e3 * profile["host_s"] / calls,
                      wait_ms_per_call=1e3 * profile["device_s"] / calls,
                      device_idle_fraction=profile["idle_s"] / wall)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="preset:tiny-llama",
                        help="checkpoint dir, .gguf, 'preset:<name>' or 'default' (SmolLM2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--steps", default="1,8sync,8",
                        help="configurations to compare: num_scheduler_steps, with 'sync' "
                             "appended to turn asynchronous scheduling off")
    parser.add_argument("--profile", action="store_true", help="report host/device time split")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write results here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    if args.model == "default":
        args.model = None
    results = [measure(args, k) for k in args.steps.split(",")]
    base = results[0]["output_tokens_per_s"]
    keys = [k for k in results[0] if k != "config"]
    print(f"\nmodel={args.model or 'SmolLM2 (default)'} requests={args.num_requests} "
          f"input={args.input_len} output={args.output_len} dtype={args.dtype}")
    print("| config | " + " | ".join(keys) + " | speedup vs first |")
    print("|---" * (len(keys) + 2) + "|")
    for r in results:
        cells = [f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in keys]
        print(f"| {r['config']} | " + " | ".join(cells)
              + f" | {r['output_tokens_per_s'] / base:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
