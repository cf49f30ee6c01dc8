#!/usr/bin/env python3
"""Time to first token of a cold start vs a second start with the compilation cache warm.

Each start is a fresh Python process that builds ``LLM(..., warmup=True)`` (compiling
every bucket, or loading the saved executables) and generates one token. The first start
uses an empty cache directory (``JAXPAGE_CACHE_DIR``: tokenizer, XLA cache, executables);
the second reuses it.

    python scripts/bench_startup.py --max-model-len 512 --max-num-seqs 8 --max-num-batched-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import time, json, sys
start = time.perf_counter()
from jaxpage import LLM, SamplingParams
options = json.loads(sys.argv[1])
llm = LLM(options.pop("model"), warmup=True, **options)
ready = time.perf_counter()
llm.generate(["Hello"] if llm.get_tokenizer() else [{"prompt_token_ids": [5, 6, 7]}],
             SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
executables = llm.llm_engine.runner.executables
print(json.dumps({"ready_s": ready - start, "first_token_s": time.perf_counter() - start,
                  "programs_loaded": executables.num_loaded,
                  "programs_compiled": executables.num_compiled}))
"""


def start_once(options: dict, cache_dir: str) -> dict:
    env = dict(os.environ, JAXPAGE_CACHE_DIR=cache_dir, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", CHILD, json.dumps(options)], env=env,
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    options = {"model": args.model, "max_model_len": args.max_model_len,
               "max_num_seqs": args.max_num_seqs,
               "max_num_batched_tokens": args.max_num_batched_tokens}
    with tempfile.TemporaryDirectory() as cache:
        cold = start_once(options, cache)
        warm = start_once(options, cache)
    ratio = cold["first_token_s"] / warm["first_token_s"]
    print("| start | engine ready (s) | first token (s) | programs compiled | programs loaded |\n"
          "|---|---|---|---|---|")
    for name, run in (("cold (empty caches)", cold), ("second (caches warm)", warm)):
        print(f"| {name} | {run['ready_s']:.1f} | {run['first_token_s']:.1f} | "
              f"{run['programs_compiled']} | {run['programs_loaded']} |")
    print(f"\nsecond start is {ratio:.1f}x faster to first token")
    if args.json:
        Path(args.json).write_text(json.dumps({"options": options, "cold": cold, "warm": warm,
                                               "ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
