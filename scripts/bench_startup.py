#!/usr/bin/env python3
"""Time to first token of a cold start and of a warm start (caches filled by the cold one).

Every start is a fresh Python process; times count from its launch. The cold start has an
empty ``JAXPAGE_CACHE_DIR`` (converted weights, tokenizer, C++ kernels, compiled
programs); the warm starts that follow reuse it. Three ways to start, each with a cache
of its own:

* ``default``: ``LLM(model)`` with every other option at its default (on the CPU the
  core warm-up; on a GPU or TPU the ready set, the rest built in the background), then
  one generated token;
* ``warmup``: ``LLM(model, warmup=True, --max-model-len ...)``, which loads or compiles
  every program of the bucket ladders before it returns, then one generated token;
* ``cli``: ``jaxpage generate "Hello" --max-tokens 1`` (to the first text it prints, and
  to its exit).

    python scripts/bench_startup.py                       # all three
    python scripts/bench_startup.py --scenarios default   # the quick one
    python scripts/bench_startup.py --scenarios warmup --max-model-len 512 --max-num-seqs 8 \\
        --max-num-batched-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("default", "warmup", "cli")

CHILD = """
import json, sys, time
launched = float(sys.argv[2])
since = lambda: time.time() - launched
from jaxpage import LLM, SamplingParams
imported = since()
options = json.loads(sys.argv[1])
llm = LLM(options.pop("model"), **options)
ready = since()
llm.generate(["Hello"] if llm.get_tokenizer() else [{"prompt_token_ids": [5, 6, 7]}],
             SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
first_token = since()
executables = llm.llm_engine.runner.executables
print(json.dumps({"import_s": imported, "ready_s": ready, "first_token_s": first_token,
                  "programs_loaded": executables.num_loaded,
                  "programs_compiled": executables.num_compiled}))
"""


def _env(cache_dir: str) -> dict:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, JAXPAGE_CACHE_DIR=cache_dir, PYTHONPATH=path)


def start_llm(options: dict, cache_dir: str) -> dict:
    result = subprocess.run([sys.executable, "-c", CHILD, json.dumps(options), repr(time.time())],
                            env=_env(cache_dir), capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"start failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def start_cli(model: str | None, cache_dir: str) -> dict:
    command = [sys.executable, "-m", "jaxpage.cli", "generate", "Hello", "--max-tokens", "1"]
    if model:
        command += ["--model", model]
    launched = time.time()
    child = subprocess.Popen(command, env=_env(cache_dir), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    child.stdout.read(1)  # the first generated text
    first_output = time.time() - launched
    _, stderr = child.communicate()
    if child.returncode != 0:
        raise RuntimeError(f"jaxpage generate failed:\n{stderr.decode()[-4000:]}")
    return {"first_token_s": first_output, "exit_s": time.time() - launched}


def cold_and_warm(start, warm_runs: int) -> dict:
    """One cold start on an empty cache, then ``warm_runs`` warm ones (the median kept)."""
    with tempfile.TemporaryDirectory(prefix="jaxpage-bench-startup-") as cache:
        cold = start(cache)
        warms = [start(cache) for _ in range(warm_runs)]
    warm = dict(warms[0])
    for key in warm:
        warm[key] = statistics.median(run[key] for run in warms)
    first = [run["first_token_s"] for run in warms]
    warm["first_token_range_s"] = [min(first), max(first)]
    return {"cold": cold, "warm": warm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--dtype", default=None, help="LLM's dtype (default: its own)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated, of {', '.join(SCENARIOS)} (default: all)")
    parser.add_argument("--warm-runs", type=int, default=3,
                        help="warm starts after each cold one; the median is reported")
    parser.add_argument("--max-model-len", type=int, default=512, help="warmup scenario")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="warmup scenario")
    parser.add_argument("--max-num-batched-tokens", type=int, default=64,
                        help="warmup scenario")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")

    dtype = {"dtype": args.dtype} if args.dtype else {}
    options = {
        "default": {"model": args.model, **dtype},
        "warmup": {"model": args.model, "warmup": True, "max_model_len": args.max_model_len,
                   "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens, **dtype},
    }
    results: dict = {}
    for scenario in scenarios:
        if scenario == "cli":
            results[scenario] = cold_and_warm(lambda cache: start_cli(args.model, cache),
                                              args.warm_runs)
        else:
            results[scenario] = cold_and_warm(
                lambda cache, o=options[scenario]: start_llm(dict(o), cache), args.warm_runs)
        print(f"{scenario}: done", file=sys.stderr, flush=True)

    llm_rows = [s for s in scenarios if s != "cli"]
    if llm_rows:
        print("| start | import (s) | engine ready (s) | first token (s) | programs compiled "
              "| programs loaded |\n|---|---|---|---|---|---|")
        for scenario in llm_rows:
            name = "`LLM()`" if scenario == "default" else "`LLM(warmup=True)`"
            for kind in ("cold", "warm"):
                run = results[scenario][kind]
                print(f"| {name}, {kind} | {run['import_s']:.1f} | {run['ready_s']:.1f} | "
                      f"{run['first_token_s']:.1f} | {run['programs_compiled']:.0f} | "
                      f"{run['programs_loaded']:.0f} |")
    if "cli" in scenarios:
        print("\n| start | first token (s) | exit (s) |\n|---|---|---|")
        for kind in ("cold", "warm"):
            run = results["cli"][kind]
            print(f"| `jaxpage generate`, {kind} | {run['first_token_s']:.1f} | "
                  f"{run['exit_s']:.1f} |")
    print()
    for scenario in scenarios:
        cold, warm = results[scenario]["cold"], results[scenario]["warm"]
        low, high = warm["first_token_range_s"]
        print(f"{scenario}: warm start {warm['first_token_s']:.1f} s to first token "
              f"(median of {args.warm_runs}, {low:.1f}-{high:.1f}), cold "
              f"{cold['first_token_s']:.1f} s: {cold['first_token_s'] / warm['first_token_s']:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"options": options, "warm_runs": args.warm_runs,
                                               "results": results}, indent=2))


if __name__ == "__main__":
    main()
