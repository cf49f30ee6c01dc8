#!/usr/bin/env python3
"""KV memory efficiency of the paged block manager, replayed on the host (no model needed).

A mixed-length workload (ShareGPT-like lengths drawn with a seed) runs through the real
Scheduler and KVCacheManager with a stand-in for the model that emits tokens until each
request's output length. Reported, side by side:

* KV utilization: tokens stored / token capacity of the allocated blocks, averaged over
  steps (a block shared by several requests counts once, at its fullest).
* Peak concurrent sequences with paged blocks, versus a contiguous allocation that
  reserves ``max_model_len`` slots per sequence in the same memory (the fragmentation
  baseline measured in the PagedAttention paper), and that baseline's wasted fraction.

    python scripts/bench_memory.py --num-requests 400 --num-blocks 2048 --block-size 16

With ``--options`` it measures the model instead: weight bytes on the device and KV blocks
for a fixed budget, for weight quantization and byte KV caches side by side:

    python scripts/bench_memory.py --options float32,int8,int4,gguf,kv_int8,kv_fp8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpage.config import SchedulerConfig  # noqa: E402
from jaxpage.core.kv.block_pool import BlockPool  # noqa: E402
from jaxpage.core.kv.kv_cache_manager import KVCacheManager  # noqa: E402
from jaxpage.core.request import Request  # noqa: E402
from jaxpage.core.sched.scheduler import Scheduler  # noqa: E402
from jaxpage.core.sched.step_result import StepResult  # noqa: E402
from jaxpage.sampling_params import SamplingParams  # noqa: E402


def sharegpt_like_lengths(rng: np.random.Generator, count: int, max_model_len: int):
    """(prompt, output) lengths: log-normal, prompt median ~160, output median ~190."""
    prompts = np.clip(rng.lognormal(5.1, 0.9, count), 4, max_model_len // 2).astype(int)
    outputs = np.clip(rng.lognormal(5.25, 0.8, count), 4, max_model_len // 2).astype(int)
    return list(zip(prompts.tolist(), outputs.tolist()))


def stored_tokens(kv: KVCacheManager, running: list[Request]) -> tuple[int, int]:
    """(tokens held in allocated blocks, allocated blocks), shared blocks counted once."""
    fill: dict[int, int] = {}
    bs = kv.block_size
    for request in running:
        for j, block in enumerate(kv.req_to_blocks.get(request.request_id, [])):
            filled = min(bs, max(0, request.num_computed_tokens - j * bs))
            fill[block.block_id] = max(fill.get(block.block_id, 0), filled)
    return sum(fill.values()), len(fill)


def run(args) -> dict:
    rng = np.random.default_rng(args.seed)
    lengths = sharegpt_like_lengths(rng, args.num_requests, args.max_model_len)
    pool = BlockPool(args.num_blocks + 1, enable_caching=False)
    kv = KVCacheManager(pool, args.block_size)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                          max_num_batched_tokens=args.max_num_batched_tokens,
                                          preemption_mode="recompute"), kv)
    for i, (prompt_len, output_len) in enumerate(lengths):
        prompt = rng.integers(10, 30000, prompt_len).tolist()
        scheduler.add_request(Request(f"r{i}", prompt,
                                      SamplingParams(max_tokens=output_len, ignore_eos=True),
                                      max_model_len=args.max_model_len))
    utilization, peak_running, steps = [], 0, 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.apply(out, StepResult(np.full(len(out.scheduled), 7, np.int32)))
        tokens, blocks = stored_tokens(kv, scheduler.running)
        if blocks:
            utilization.append(tokens / (blocks * args.block_size))
        peak_running = max(peak_running, len(scheduler.running))
        steps += 1
    capacity = args.num_blocks * args.block_size
    contiguous_seqs = capacity // args.max_model_len
    mean_len = float(np.mean([p + o for p, o in lengths]))
    return {
        "num_requests": args.num_requests, "num_blocks": args.num_blocks,
        "block_size": args.block_size, "max_model_len": args.max_model_len, "steps": steps,
        "kv_utilization_mean": float(np.mean(utilization)),
        "kv_utilization_min_after_warmup": float(np.min(utilization[len(utilization) // 10:])),
        "paged_peak_concurrent_seqs": peak_running,
        "contiguous_max_concurrent_seqs": contiguous_seqs,
        "concurrency_ratio": peak_running / max(contiguous_seqs, 1),
        "contiguous_waste_fraction": 1 - mean_len / args.max_model_len,
        "num_preemptions": scheduler.num_preemptions,
    }


MODEL_OPTIONS = {"float32": {}, "int8": {"quantization": "int8"},
                 "int4": {"quantization": "int4"}, "gguf": {"quantization": "gguf"},
                 "kv_int8": {"kv_cache_dtype": "int8"}, "kv_fp8": {"kv_cache_dtype": "fp8"},
                 "kv_fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2"},
                 "int8+kv_int8": {"quantization": "int8", "kv_cache_dtype": "int8"}}


def run_options(args) -> list[dict]:
    """The embedded SmolLM2 under each option: weight bytes on the device, KV bytes per
    block, and KV blocks for the same ``--kv-budget`` bytes."""
    from jaxpage import LLM

    rows = []
    for name in args.options.split(","):
        if name not in MODEL_OPTIONS:
            raise SystemExit(f"--options: {name!r} is not one of {sorted(MODEL_OPTIONS)}")
        llm = LLM(kv_cache_memory=args.kv_budget, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, **MODEL_OPTIONS[name])
        stats = llm.get_stats()
        rows.append({"option": name, "weight_bytes": stats["weight_bytes"],
                     "kv_bytes_per_block": stats["kv_bytes_per_block"],
                     "num_kv_blocks": stats["num_kv_blocks"]})
        del llm
    base = rows[0]
    print(f"SmolLM2-135M-Instruct (embedded GGUF), KV budget {args.kv_budget / 2**20:.0f} MiB, "
          f"block size 16; ratios against the first row ({base['option']})")
    print("| option | weight MiB | vs first | KV bytes / block | KV blocks | vs first |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['option']} | {row['weight_bytes'] / 2**20:.1f} | "
              f"{row['weight_bytes'] / base['weight_bytes']:.1%} | {row['kv_bytes_per_block']:,} | "
              f"{row['num_kv_blocks']:,} | {row['num_kv_blocks'] / base['num_kv_blocks']:.2f}x |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--num-blocks", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=str, default=None, help="also write the result here")
    parser.add_argument("--options", default=None,
                        help="instead of the replay: load SmolLM2 under each option (comma "
                             f"list of {', '.join(MODEL_OPTIONS)}) and report weight bytes "
                             "and KV blocks for --kv-budget")
    parser.add_argument("--kv-budget", type=int, default=256 * 2**20,
                        help="bytes of KV cache for --options (default 256 MiB)")
    args = parser.parse_args()
    if args.options:
        rows = run_options(args)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return
    result = run(args)
    print("| metric | value |\n|---|---|")
    for key, value in result.items():
        print(f"| {key} | {value:.4f} |" if isinstance(value, float) else f"| {key} | {value} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
