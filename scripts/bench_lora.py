"""Multi-LoRA cost: the delta's two forms, and the engine with adapters against without.

    python scripts/bench_lora.py [--requests 32] [--max-tokens 48] [--skip-engine]

1. The delta of one projection (SmolLM2's MLP shape, 576 -> 1536, rank 16) for T tokens
   and L slots: ``mask`` (every slot's A and B once, masked per token), ``gather`` (each
   token's own A and B gathered), beside the base projection itself; median ms per jitted
   call, both forms checked equal. ``jaxpage.models.lora`` gathers when T < L.
2. The default model (SmolLM2-135M, float32) generating the same requests: LoRA off,
   LoRA on with every request on the base model, and four random rank-16 adapters (PEFT
   files written here) mixed with the base model in every batch. Output tokens/s, one
   run each after a warm-up run, ratios against LoRA off.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import median_ms  # noqa: E402


def bench_delta(size_in: int = 576, size_out: int = 1536, rank: int = 16) -> None:
    from jaxpage.models.lora import LoRATokens, lora_delta

    print(f"delta of one projection {size_in} -> {size_out}, rank {rank} (ms, median)")
    print(f"{'T':>5} {'L':>4} {'base':>8} {'mask':>8} {'gather':>8}  engine uses")
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((size_in, size_out)), jnp.float32)
    base = jax.jit(lambda x, w: x @ w)
    for slots in (4, 32):
        a = jnp.asarray(rng.standard_normal((size_in, slots * rank)) * 0.1, jnp.float32)
        b = jnp.asarray(rng.standard_normal((slots * rank, size_out)) * 0.1, jnp.float32)
        for tokens in (1, 8, 64, 512):
            x = jnp.asarray(rng.standard_normal((tokens, size_in)), jnp.float32)
            slot = jnp.asarray(rng.integers(0, slots + 1, tokens), jnp.int32)
            columns = jnp.arange(slots * rank) // rank + 1
            mask = (slot[:, None] == columns[None, :]).astype(jnp.float32)
            masked = jax.jit(lambda x, a, b, s, m: lora_delta(
                x, a, b, LoRATokens(s, m, (slots, rank))))
            gathered = jax.jit(lambda x, a, b, s: lora_delta(
                x, a, b, LoRATokens(s, None, (slots, rank))))
            np.testing.assert_allclose(masked(x, a, b, slot, mask), gathered(x, a, b, slot),
                                       rtol=1e-3, atol=1e-3)
            print(f"{tokens:>5} {slots:>4} {median_ms(base, x, w):>8.3f} "
                  f"{median_ms(masked, x, a, b, slot, mask):>8.3f} "
                  f"{median_ms(gathered, x, a, b, slot):>8.3f}  "
                  f"{'gather' if tokens < slots else 'mask'}")


def write_adapter(directory: str, arch, rank: int, seed: int) -> str:
    """A random PEFT adapter (safetensors) on every projection of ``arch``."""
    from safetensors.numpy import save_file

    from jaxpage.models.peft_adapter import LORA_TARGETS, projection_shape

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for target in LORA_TARGETS:
            size_in, size_out = projection_shape(arch, target)
            module = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{module}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = (
                rng.standard_normal((rank, size_in)) / np.sqrt(size_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (
                rng.standard_normal((size_out, rank)) * 0.02).astype(np.float32)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(LORA_TARGETS)}, f)
    return directory


def bench_engine(num_requests: int, max_tokens: int) -> None:
    from jaxpage import LLM, LoRARequest, SamplingParams

    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(100, 20000, 24 + i % 40).tolist()}
               for i in range(num_requests)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    options = dict(max_num_seqs=32, max_num_batched_tokens=512, num_kv_blocks=512)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for label, lora_options, mixed in (
                ("LoRA off", {}, False),
                ("LoRA on, base model only", dict(enable_lora=True, max_loras=4), False),
                ("4 adapters + base, mixed", dict(enable_lora=True, max_loras=4), True)):
            llm = LLM(**options, **lora_options)
            loras = None
            if mixed:
                arch = llm.llm_engine.loras.arch
                adapters = [LoRARequest(f"a{i}", i + 1, write_adapter(
                    os.path.join(root, f"a{i}"), arch, 16, i)) for i in range(4)]
                loras = [None if i % 5 == 4 else adapters[i % 4] for i in range(num_requests)]
            llm.generate(prompts, params, lora_request=loras, use_tqdm=False)  # compiles
            start = time.perf_counter()
            outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            rows.append((label, tokens / seconds))
            del llm
    base = rows[0][1]
    print(f"\nSmolLM2-135M float32, {num_requests} requests x {max_tokens} output tokens")
    print(f"{'':<28} {'out tok/s':>10} {'vs off':>7}")
    for label, rate in rows:
        print(f"{label:<28} {rate:>10.1f} {rate / base:>6.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d')}, jax {jax.__version__}, {jax.devices()[0].platform}")
    bench_delta()
    if not args.skip_engine:
        bench_engine(args.requests, args.max_tokens)


if __name__ == "__main__":
    main()
