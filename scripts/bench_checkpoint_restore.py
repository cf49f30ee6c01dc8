#!/usr/bin/env python3
"""Start-up from a converted orbax checkpoint vs from safetensors and the original file.

Loads ``--model`` (default: the embedded SmolLM2-135M GGUF, which must be dequantized)
sharded over ``--tensor-parallel-size`` virtual CPU devices. When the model is a GGUF
file, ``transformers`` also converts it to Hugging Face safetensors directories in float32
and in bfloat16 (the usual published format; nothing is downloaded). The engine saves it with
``LLM.save_sharded_checkpoint``; then the script times ``load_model`` from each source
(best of ``--repeats``, weights ready on their devices) and ``LLM(...)`` construction
from each, and checks that all give the same greedy tokens.

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
    def start_and_generate(source: str) -> tuple[float, list[int], "LLM"]:
        start = time.perf_counter()
        llm = LLM(source, **engine)
        seconds = time.perf_counter() - start
        return seconds, llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids, llm

    with tempfile.TemporaryDirectory() as tmp:
        sources = {"original": model}
        if model.endswith(".gguf"):
            for dtype in ("float32", "bfloat16"):
                sources[f"safetensors_{dtype}"] = gguf_to_safetensors(
                    model, os.path.join(tmp, f"hf-{dtype}"), dtype)
        init, tokens = {}, {}
        for name, source in list(sources.items()):
            init[name], tokens[name], llm = start_and_generate(source)
            if name == "original":
                sources["orbax"] = llm.save_sharded_checkpoint(os.path.join(tmp, "converted"))
            del llm
        init["orbax"], tokens["orbax"], llm = start_and_generate(sources["orbax"])
        del llm
        result = {"model": model, "tensor_parallel_size": tp, "dtype": args.dtype,
                  "jax": jax.__version__, "devices": f"{args.devices} virtual CPU devices"}
        for name, source in sources.items():
            result[f"load_{name}_s"] = round(time_load(source), 3)
        for name in sources:
            result[f"llm_init_{name}_s"] = round(init[name], 3)
        for name in sources:
            result[f"same_tokens_{name}"] = tokens[name] == tokens["original"]
            if name.startswith("safetensors"):
                result[f"orbax_load_speedup_vs_{name}"] = round(
                    result[f"load_{name}_s"] / result["load_orbax_s"], 2)
    print(json.dumps(result, indent=1))


def gguf_to_safetensors(gguf_path: str, out_dir: str, dtype: str) -> str:
    """Write a GGUF model as a Hugging Face safetensors directory in ``dtype`` (bfloat16 is
    how checkpoints are usually published) with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers will not save a model it read from GGUF: copy it into a plain one.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.to(getattr(torch, dtype)).save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    main()
