"""Speculative decoding (n-gram prompt lookup) against plain decoding, side by side.

The workload quotes its input: each request asks the model to copy, or copy with a small
edit, a passage of this repository's own docs and source (real text, not random ids), the
case prompt lookup is for. The same prompts run through two engines in one process, one
with ``speculative_config`` and one without, at each batch size, greedy: the outputs must
be equal token for token (the script fails otherwise), and the ratio of output tokens/s
is the speed-up. Each configuration is run once untimed first (compiles), then timed.

    python scripts/bench_spec_decode.py                         # SmolLM2, batch 1, 4, 32, k=7
    python scripts/bench_spec_decode.py --batches 1 --max-tokens 64 --model preset:tiny-llama
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import ROOT, environment, markdown_table, resolve_model, write_report  # noqa: E402

# Passages come from these files, in this order (the repository's own prose and code).
SOURCES = ("README.md", "docs/architecture.md", "jaxpage/core/kv/kv_cache_manager.py",
           "jaxpage/core/sched/scheduler.py", "jaxpage/config.py", "docs/benchmarks/host_overhead.md")
TASKS = ("Copy the following text exactly, with nothing before or after it:\n\n{}",
         "Rewrite the following text, replacing every occurrence of the word \"the\" with "
         "\"THE\" and changing nothing else:\n\n{}",
         "Extract the first three lines of the following text, exactly as written:\n\n{}")


def passages(count: int, chars: int = 600) -> list[str]:
    """``count`` passages of about ``chars`` characters, cut at line ends."""
    found = []
    for name in SOURCES:
        lines = (ROOT / name).read_text().splitlines()
        block: list[str] = []
        for line in lines:
            block.append(line)
            if sum(len(x) + 1 for x in block) >= chars:
                text = "\n".join(block).strip()
                if text:
                    found.append(text)
                block = []
                if len(found) == count:
                    return found
    if not found:
        raise RuntimeError("no passages found")
    return [found[i % len(found)] for i in range(count)]


def prompts_for(tokenizer, count: int) -> list[dict]:
    """Chat prompts of the tasks over ``count`` passages, as token ids. Without a
    tokenizer (a preset's random weights) the text's bytes stand in for token ids."""
    prompts = []
    for i, passage in enumerate(passages(count)):
        text = TASKS[i % len(TASKS)].format(passage)
        if tokenizer is None:
            ids = [5 + byte for byte in text.encode()][:512]
        else:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                tokenize=True, return_dict=True,
                                                add_generation_prompt=True)["input_ids"]
        prompts.append({"prompt_token_ids": list(ids)})
    return prompts


def run(llm, rounds, params) -> tuple[float, list[list[int]]]:
    """Each round's prompts in one ``generate`` call, the rounds one after another."""
    start = time.perf_counter()
    tokens = []
    for prompts in rounds:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens += [list(o.outputs[0].token_ids) for o in outputs]
    return time.perf_counter() - start, tokens


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--batches", default="1,4,32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--min-requests", type=int, default=6,
                        help="requests per batch size at least (in rounds of the batch size)")
    # 7: a verify row of k + 1 = 8 tokens fills its rung of the verify ladder; on the CPU
    # this is what reaches 1.5x at batch 1 (docs/speculative_decoding.md). The engine's
    # own default is 4.
    parser.add_argument("--num-speculative-tokens", type=int, default=7)
    parser.add_argument("--prompt-lookup-min", type=int, default=None,
                        help="default: the engine's default")
    parser.add_argument("--prompt-lookup-max", type=int, default=None,
                        help="default: the engine's default")
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="default: the engine's default")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="per engine (default: sized from memory; two engines share it)")
    parser.add_argument("--allow-mismatch", action="store_true",
                        help="report how many outputs equal plain decoding's instead of failing "
                             "(bfloat16 on a GPU: a 5-token verify step and a 1-token step may "
                             "round differently, and random weights make near-ties common)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "results"))
    parser.add_argument("--stem", default="spec_decode")
    args = parser.parse_args(argv)

    from jaxpage import LLM, SamplingParams

    model = resolve_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    spec_config = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    for name in ("prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
        if getattr(args, name) is not None:
            spec_config[name] = getattr(args, name)
    # warmup=False: the untimed pass compiles the shapes the rounds need, and no more (the
    # engine's own warm-up compiles every bucket: minutes per shape set on a GPU).
    common = dict(max_num_seqs=max(batches), enable_prefix_caching=False, dtype=args.dtype,
                  warmup=False)
    if args.num_kv_blocks is not None:
        common["num_kv_blocks"] = args.num_kv_blocks
    plain = LLM(model, **common)
    spec = LLM(model, speculative_config=spec_config, **common)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    all_prompts = prompts_for(plain.get_tokenizer(), max(max(batches), args.min_requests))
    rows = []
    for batch in batches:
        # At least --min-requests requests per batch size (one passage alone is noise).
        count = batch * max(1, -(-args.min_requests // batch))
        prompts = [all_prompts[i % len(all_prompts)] for i in range(count)]
        rounds = [prompts[i:i + batch] for i in range(0, count, batch)]
        for llm in (plain, spec):
            run(llm, rounds, params)  # untimed: compiles every shape the rounds need
        before = spec.get_stats()
        plain_s, plain_out = run(plain, rounds, params)
        spec_s, spec_out = run(spec, rounds, params)
        after = spec.get_stats()
        same = sum(a == b for a, b in zip(plain_out, spec_out))
        if same != len(plain_out) and not args.allow_mismatch:
            raise SystemExit(f"batch {batch}: speculative outputs differ from plain decoding")
        tokens = sum(len(t) for t in plain_out)
        drafts = after["spec_num_drafts"] - before["spec_num_drafts"]
        proposed = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
        accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
        row = {"batch": batch, "requests": count, "output_tokens": tokens,
               "plain_tok_s": tokens / plain_s, "spec_tok_s": tokens / spec_s,
               "speedup": plain_s / spec_s, "proposed": proposed, "accepted": accepted,
               "acceptance_rate": accepted / proposed if proposed else 0.0,
               "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,
               "identical_outputs": True if same == len(plain_out) else f"{same}/{len(plain_out)}"}
        rows.append(row)
        print(f"batch {batch:3d}: plain {row['plain_tok_s']:7.1f} tok/s, speculative "
              f"{row['spec_tok_s']:7.1f} tok/s ({row['speedup']:.2f}x); acceptance "
              f"{row['acceptance_rate']:.2f}, mean accepted length "
              f"{row['mean_accepted_length']:.2f}", flush=True)
    columns = [("batch", "batch"), ("requests", "requests"), ("output_tokens", "output tokens"),
               ("plain_tok_s", "plain tok/s"), ("spec_tok_s", "n-gram speculation tok/s"),
               ("speedup", "speed-up"), ("acceptance_rate", "acceptance rate"),
               ("mean_accepted_length", "mean accepted length"),
               ("identical_outputs", "same tokens")]
    table = markdown_table(rows, columns)
    print(table)
    payload = {"environment": environment(), "model": model or "SmolLM2-135M-Instruct (GGUF)",
               "dtype": args.dtype,
               "speculative_config": spec.llm_engine.config.scheduler.speculative.__dict__,
               "max_tokens": args.max_tokens, "rows": rows}
    paths = write_report(args.out, args.stem, title="Speculative decoding (n-gram) vs plain "
                         "decoding", payload=payload, table=table)
    print("wrote", ", ".join(str(p) for p in paths.values()))
    return rows


if __name__ == "__main__":
    main()
