"""How many programs an engine builds before it is ready, and in all, per target and model.

Counts the program set (``jaxpage.core.batch.program_set``) that ``LLM(warmup="ready")`` builds
and ``jaxpage plan --buckets warmup|all`` compiles, without compiling anything; beside it,
the same set over the product ladders the accelerators used before (every block-table
width, seats by sequence count), as the baseline. Needs the deviceless compilers for the
target descriptions (``make install-compilers``).

    python scripts/count_programs.py                      # the table in docs/benchmarks/startup.md
    python scripts/count_programs.py --targets h100 --models preset:llama3-8b
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

# tpu-inference's CI settings for Llama-3.1-8B (issue [16]'s targets)
TARGET_SETTINGS = dict(max_num_seqs=256, max_model_len=8192, max_num_batched_tokens=1024)


def counts(model: str | None, target: str, tp: int, settings: dict) -> tuple[int, int, int]:
    """(ready, all, all over the product ladders) for one model, target and settings."""
    from jaxpage.config import EngineConfig
    from jaxpage.core.batch.builder import BatchBuilder
    from jaxpage.core.batch.program_set import program_set
    from jaxpage.parallel.targets import target_devices
    from jaxpage.planning.abstract_engine import AbstractEngine

    config = EngineConfig.from_kwargs(model=model, dtype="bfloat16", tensor_parallel_size=tp,
                                      **settings)
    engine = AbstractEngine(config, target_devices(target), num_kv_blocks=16_000)
    programs = engine.program_set()
    product = BatchBuilder(engine.builder.kv, max_num_batched_tokens=config.scheduler
                           .max_num_batched_tokens, max_num_seqs=engine.max_num_seqs,
                           max_model_len=engine.max_model_len,
                           bucket_growth=config.scheduler.bucket_growth)
    before = program_set(product, num_steps=engine.num_steps, host_decides=engine.host_decides,
                         move_sizes=engine.move_sizes, penalty_width=512)
    return len(programs.ready), len(programs.all), len(before.all)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="h100,v6e:1x1,v5e:1x1,v5e:2x4")
    parser.add_argument("--models", default="preset:llama3-8b,preset:qwen2-7b,default")
    args = parser.parse_args()
    print("| model | target | settings | ready | in all | product ladders (before) |")
    print("|---|---|---|---|---|---|")
    for model in args.models.split(","):
        for target in args.targets.split(","):
            tp = 8 if target == "v5e:2x4" else 1
            for name, settings in (("issue [16] targets", TARGET_SETTINGS), ("defaults", {})):
                try:
                    ready, total, before = counts(None if model == "default" else model,
                                                  target, tp, settings)
                except ValueError as error:  # e.g. a context longer than the model's
                    print(f"| {model} | {target} | {name} | {error} | | |")
                    continue
                print(f"| {model} | {target}{' (TP=8)' if tp > 1 else ''} | {name} | "
                      f"{ready} | {total} | {before} |")


if __name__ == "__main__":
    main()
