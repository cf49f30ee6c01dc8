"""Structured outputs (JSON schemas through llguidance masks) against unconstrained
decoding of the same requests, side by side in one process.

1. **All constrained**: 32 chat requests, each with a JSON schema (sampled, seeded).
   Every output must validate (``jsonschema``); the script fails otherwise. The same
   requests then run unconstrained with ``max_tokens`` set to each constrained output's
   length and ``ignore_eos``, so both runs produce the same tokens per request and the
   ratio of output tokens/s is the price of the masks.
2. **A quarter constrained**: 8 of the 32 carry their schema, the other 24 run free;
   compared with the same 32 requests all free, lengths matched the same way.
3. **A slow compile**: through ``AsyncLLMEngine``, 8 free requests with and without one
   constrained request submitted first at the same moment; the others' time to first
   token, in engine steps. Twice: a real slow schema (a 70,000-string enum, the biggest
   llguidance's default limits take: a fraction of a second here), and the same with the
   compile made 3 s longer (a sleep inside ``GrammarCompiler.compile``, which like
   llguidance's compile releases the GIL): what a schema that compiles for seconds does.

Each configuration runs once untimed (compiles), then timed.

    python scripts/bench_structured.py
    python scripts/bench_structured.py --requests 8 --max-tokens 48    # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import ROOT, environment, markdown_table, resolve_model, write_report  # noqa: E402

SUBJECTS = ("a person", "a city", "a book", "a product in a shop", "a weather report",
            "a recipe", "a football match", "a planet")
SCHEMAS = (
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                      "country": {"type": "string", "maxLength": 40},
                                      "population": {"type": "integer", "minimum": 0,
                                                             "maximum": 10**9}},
     "required": ["city", "country", "population"]},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60},
                                      "year": {"type": "integer", "minimum": 0, "maximum": 2100},
                                      "tags": {"type": "array", "items": {"type": "string",
                                                                          "maxLength": 20},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["title", "year", "tags"]},
    {"type": "object", "properties": {"product": {"type": "string", "maxLength": 40},
                                      "price": {"type": "integer", "minimum": 0,
                                                "maximum": 10000},
                                      "in_stock": {"type": "boolean"}},
     "required": ["product", "price", "in_stock"]},
    {"type": "object", "properties": {"sky": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                                      "celsius": {"type": "integer", "minimum": -60,
                                                  "maximum": 60}},
     "required": ["sky", "celsius"]},
    {"type": "object", "properties": {"dish": {"type": "string", "maxLength": 40},
                                      "steps": {"type": "array", "maxItems": 3,
                                                "items": {"type": "string", "maxLength": 60}}},
     "required": ["dish", "steps"]},
    {"type": "object", "properties": {"home": {"type": "string", "maxLength": 30},
                                      "away": {"type": "string", "maxLength": 30},
                                      "score": {"type": "array", "minItems": 2, "maxItems": 2,
                                                "items": {"type": "integer", "minimum": 0,
                                                          "maximum": 20}}},
     "required": ["home", "away", "score"]},
    {"type": "object", "properties": {"planet": {"type": "string", "maxLength": 20},
                                      "moons": {"type": "integer", "minimum": 0,
                                                "maximum": 200}},
     "required": ["planet", "moons"]},
)


def requests_for(tokenizer, count: int) -> list[tuple[dict, dict]]:
    """(prompt as token ids, schema) per request, cycling through the subjects."""
    out = []
    for i in range(count):
        subject, schema = SUBJECTS[i % len(SUBJECTS)], SCHEMAS[i % len(SCHEMAS)]
        text = f"Describe {subject} as a JSON object. Example {i}."
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                            return_dict=True, add_generation_prompt=True)
        out.append(({"prompt_token_ids": list(ids["input_ids"])}, schema))
    return out


def run(llm, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def timed_pair(llm, prompts, params_a, params_b) -> tuple[float, list, float, list]:
    """Both configurations once untimed, then each timed."""
    run(llm, prompts, params_a)
    run(llm, prompts, params_b)
    a_s, a_out = run(llm, prompts, params_a)
    b_s, b_out = run(llm, prompts, params_b)
    return a_s, a_out, b_s, b_out


def check_valid(outputs, schemas) -> int:
    import json

    import jsonschema

    for output, schema in zip(outputs, schemas):
        text = output.outputs[0].text
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as error:
            raise SystemExit(f"a constrained output does not validate: {text!r} ({error})")
    return len(outputs)


async def first_token_times(engine, prompts, params, slow=None) -> list[float]:
    """Seconds to the first token of each of ``prompts``, all submitted at once (the slow
    request, when given, first)."""
    async def one(prompt, p):
        start = time.perf_counter()
        first = None
        stream = await engine.add_request(prompt, p)
        async with stream:
            async for output in stream:
                if first is None and any(o.token_ids for o in output.outputs):
                    first = time.perf_counter() - start
        return first

    tasks = []
    if slow is not None:
        tasks.append(asyncio.create_task(one(*slow)))
        await asyncio.sleep(0)  # the slow request's compile starts first
    tasks += [asyncio.create_task(one(p, params)) for p in prompts]
    times = await asyncio.gather(*tasks)
    return list(times[1:] if slow is not None else times)


def slow_compile_case(llm, prompts, seed: int, extra_s: float = 0.0) -> dict:
    from jaxpage import SamplingParams, StructuredOutputsParams
    from jaxpage.engine.async_llm_engine import AsyncLLMEngine

    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(12))
             for _ in range(70000)]
    slow_spec = StructuredOutputsParams(json={"type": "object", "properties": {
        "key": {"enum": words}}, "required": ["key"]})
    fast = SamplingParams(max_tokens=8, temperature=0, output_kind="delta")
    slow = (prompts[0], SamplingParams(max_tokens=8, temperature=0, output_kind="delta",
                                       structured_outputs=slow_spec))
    engine = AsyncLLMEngine(llm.llm_engine)
    grammars = llm.llm_engine.grammars
    real_compile = grammars.compile

    def slow_compile(spec):
        time.sleep(extra_s)
        return real_compile(spec)

    grammars.compile = slow_compile
    try:
        compile_s = time.perf_counter()
        grammars.compile(slow_spec)  # how long the compile takes alone
        compile_s = time.perf_counter() - compile_s
        grammars._cache.clear()      # the timed run compiles it again
        asyncio.run(first_token_times(engine, prompts, fast))  # untimed
        base = asyncio.run(first_token_times(engine, prompts, fast))
        before = llm.llm_engine.device_calls.step_profile["calls"]
        t0 = time.perf_counter()
        with_slow = asyncio.run(first_token_times(engine, prompts, fast, slow))
        elapsed = time.perf_counter() - t0
        steps = llm.llm_engine.device_calls.step_profile["calls"] - before
    finally:
        engine.shutdown()
        del grammars.compile
    step_s = elapsed / max(steps, 1)
    delay = max(with_slow) - max(base)
    return {"compile_s": compile_s, "ttft_without_s": max(base), "ttft_with_s": max(with_slow),
            "delay_s": delay, "step_s": step_s, "delay_steps": delay / step_s}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    parser.add_argument("--stem", default="structured_outputs")
    args = parser.parse_args(argv)

    from jaxpage import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(resolve_model(args.model), max_num_seqs=args.requests, warmup=False,
              enable_prefix_caching=False)
    cases = requests_for(llm.get_tokenizer(), args.requests)
    prompts = [prompt for prompt, _ in cases]

    def constrained(i: int, schema: dict) -> SamplingParams:
        return SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=args.seed + i,
                              structured_outputs=StructuredOutputsParams(json=schema))

    def free(i: int, length: int) -> SamplingParams:
        return SamplingParams(max_tokens=max(length, 1), temperature=0.7, seed=args.seed + i,
                              ignore_eos=True)

    rows = []
    all_constrained = [constrained(i, s) for i, (_, s) in enumerate(cases)]
    probe = llm.generate(prompts, all_constrained, use_tqdm=False)
    lengths = [len(o.outputs[0].token_ids) for o in probe]
    unconstrained = [free(i, n) for i, n in enumerate(lengths)]
    c_s, c_out, u_s, u_out = timed_pair(llm, prompts, all_constrained, unconstrained)
    valid = check_valid(c_out, [s for _, s in cases])
    tokens_c = sum(len(o.outputs[0].token_ids) for o in c_out)
    tokens_u = sum(len(o.outputs[0].token_ids) for o in u_out)
    rows.append({"case": f"all {args.requests} constrained", "valid": f"{valid}/{valid}",
                 "constrained_tok_s": tokens_c / c_s, "free_tok_s": tokens_u / u_s,
                 "ratio": (tokens_c / c_s) / (tokens_u / u_s), "target": 0.7})

    quarter = max(1, args.requests // 4)
    mixed = [all_constrained[i] if i < quarter else free(i, args.max_tokens)
             for i in range(args.requests)]
    probe = llm.generate(prompts, mixed, use_tqdm=False)
    lengths = [len(o.outputs[0].token_ids) for o in probe]
    matched = [free(i, n) for i, n in enumerate(lengths)]
    m_s, m_out, f_s, f_out = timed_pair(llm, prompts, mixed, matched)
    valid = check_valid(m_out[:quarter], [s for _, s in cases[:quarter]])
    tokens_m = sum(len(o.outputs[0].token_ids) for o in m_out)
    tokens_f = sum(len(o.outputs[0].token_ids) for o in f_out)
    rows.append({"case": f"{quarter} of {args.requests} constrained", "valid": f"{valid}/{valid}",
                 "constrained_tok_s": tokens_m / m_s, "free_tok_s": tokens_f / f_s,
                 "ratio": (tokens_m / m_s) / (tokens_f / f_s), "target": 0.9})
    for row in rows:
        print(f"{row['case']}: constrained {row['constrained_tok_s']:.1f} tok/s, free "
              f"{row['free_tok_s']:.1f} tok/s: {row['ratio']:.2f}x (target >= {row['target']})",
              flush=True)

    profile = llm.llm_engine.device_calls.step_profile
    grammar_ms = 1e3 * profile["grammar_s"] / max(profile["calls"], 1)
    print(f"grammar masks and advances: {grammar_ms:.2f} ms per engine step on average "
          "(over every step of the runs above)", flush=True)
    slows = [slow_compile_case(llm, prompts[:8], args.seed),
             slow_compile_case(llm, prompts[:8], args.seed, extra_s=3.0)]
    for slow in slows:
        print(f"slow compile ({slow['compile_s']:.2f} s alone): the other requests' first "
              f"token {slow['delay_s'] * 1e3:+.0f} ms ({slow['delay_steps']:+.2f} steps of "
              f"{slow['step_s'] * 1e3:.0f} ms)", flush=True)

    columns = [("case", "case"), ("valid", "outputs valid"),
               ("constrained_tok_s", "with schemas, tok/s"), ("free_tok_s", "all free, tok/s"),
               ("ratio", "ratio"), ("target", "target")]
    table = markdown_table(rows, columns)
    notes = "\n".join(
        [f"Host time for grammars (mask fills and advances): {grammar_ms:.2f} ms per engine "
         "step on average.", ""]
        + [f"Slow compile: a schema whose compile takes {slow['compile_s']:.2f} s alone "
           f"({'3 s of it a sleep' if i else 'a 70,000-string enum'}), submitted at the same "
           "moment as 8 free requests: their last first token came "
           f"{slow['delay_s'] * 1e3:+.0f} ms later than without it "
           f"({slow['delay_steps']:+.2f} engine steps of {slow['step_s'] * 1e3:.0f} ms; "
           "target: at most one step).  " for i, slow in enumerate(slows)])
    print(table)
    print(notes)
    payload = {"environment": environment(), "model": args.model or "SmolLM2-135M-Instruct (GGUF)",
               "requests": args.requests, "max_tokens": args.max_tokens, "rows": rows,
               "grammar_ms_per_step": grammar_ms, "slow_compile": slows}
    paths = write_report(args.out, args.stem, title="Structured outputs vs free decoding",
                         payload=payload, table=table, notes=notes)
    print("wrote", ", ".join(str(p) for p in paths.values()))
    return payload


if __name__ == "__main__":
    main()
