#!/usr/bin/env python3
"""Start-up from a converted orbax checkpoint vs from the original checkpoint.

Loads ``--model`` (default: the embedded SmolLM2-135M GGUF, which must be dequantized)
sharded over ``--tensor-parallel-size`` virtual CPU devices, saves it with
``LLM.save_sharded_checkpoint``, then times ``load_model`` from each source (best of
``--repeats``, weights ready on their devices) and ``LLM(...)`` construction from each,
and checks that both give the same greedy tokens.

    python scripts/bench_checkpoint_restore.py --tensor-parallel-size 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tensor-parallel-size", type=int, default=3)
    parser.add_argument("--devices", type=int, default=8, help="virtual CPU devices")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}")
    sys.path.insert(0, str(ROOT))
    import jax
    from flax import nnx

    from jaxpage import LLM, SamplingParams
    from jaxpage.models.loader import default_model_path, load_model
    from jaxpage.parallel.placement import replica_meshes

    model = args.model or default_model_path()
    tp = args.tensor_parallel_size
    mesh = replica_meshes(tp, 1)[0]

    def time_load(source: str) -> float:
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            loaded = load_model(source, dtype=args.dtype, mesh=mesh)
            jax.block_until_ready(jax.tree.leaves(nnx.state(loaded.model)))
            best = min(best, time.perf_counter() - start)
            del loaded
        return best

    engine = dict(tensor_parallel_size=tp, dtype=args.dtype, max_model_len=256, max_num_seqs=4,
                  max_num_batched_tokens=32, num_kv_blocks=64)
    prompt = [{"prompt_token_ids": [1, 504, 3458, 282, 4649, 314]}]
    params = SamplingParams(temperature=0, max_tokens=8)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        llm = LLM(model, **engine)
        init_original = time.perf_counter() - start
        tokens = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        path = llm.save_sharded_checkpoint(os.path.join(tmp, "converted"))
        del llm
        start = time.perf_counter()
        restored_llm = LLM(path, **engine)
        init_restored = time.perf_counter() - start
        again = restored_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        del restored_llm
        result = {"model": model, "tensor_parallel_size": tp, "dtype": args.dtype,
                  "load_original_s": round(time_load(model), 3),
                  "load_orbax_s": round(time_load(path), 3),
                  "llm_init_original_s": round(init_original, 3),
                  "llm_init_orbax_s": round(init_restored, 3),
                  "same_tokens": tokens == again}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
