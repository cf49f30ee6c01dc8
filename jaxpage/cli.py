"""Command line: ``jaxpage generate``.

Engine options mirror ``LLM``'s keyword arguments (``--max-num-seqs`` is
``max_num_seqs``); ``--config FILE.toml`` reads them from a file like
``configs/engine.toml``, and flags given on the command line win.
"""

from __future__ import annotations

import argparse
import sys

ENGINE_FLAGS = {
    "dtype": (str, "compute dtype: auto, float32, bfloat16, float16"),
    "max_model_len": (int, "context length (default: the model's)"),
    "max_num_seqs": (int, "most sequences in one step"),
    "max_num_batched_tokens": (int, "token budget of one step (long prompts are chunked)"),
    "block_size": (int, "tokens per KV block"),
    "num_kv_blocks": (int, "KV blocks (default: sized from --kv-cache-memory)"),
    "kv_cache_memory": (int, "bytes for the KV cache when --num-kv-blocks is unset"),
    "seed": (int, "engine seed for requests without their own"),
    "attention_backend": (str, "auto, reference, gpu or tpu"),
    "tensor_parallel_size": (int, "devices per model replica (sharded Megatron-style)"),
    "data_parallel_size": (int, "model replicas on disjoint device groups"),
    "coordinator_address": (str, "host:port of process 0 (several processes / hosts)"),
    "num_processes": (int, "processes in the job (same command on each)"),
    "process_id": (int, "this process's rank; 0 runs the scheduler"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxpage", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--model", default=None,
                     help="HF checkpoint directory or .gguf file (default: embedded SmolLM2)")
    gen.add_argument("--tokenizer", default=None, help="tokenizer directory or .gguf file")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sample-seed", type=int, default=None, help="seed of this request")
    gen.add_argument("--config", default=None, help="TOML file of engine options")
    for name, (kind, help_text) in ENGINE_FLAGS.items():
        gen.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from jaxpage.config import load_toml_options
    from jaxpage.engine.llm import LLM
    from jaxpage.sampling_params import SamplingParams

    options = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    try:
        if args.config:
            options = {**load_toml_options(args.config), **options}
        llm = LLM(args.model, tokenizer=args.tokenizer, **options)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.sample_seed)
        if args.chat:
            outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
        else:
            outputs = llm.generate([args.prompt], params, use_tqdm=False)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(outputs[0].outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
