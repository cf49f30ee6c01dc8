#!/usr/bin/env python3
"""Offline throughput: jaxpage against Hugging Face ``generate``, same device, same dtype.

A workload from ``configs/workloads/`` (``random``: fixed lengths; ``sharegpt-like``:
seeded log-normal lengths, see that file) runs with ``ignore_eos`` on:

* ``jaxpage``: ``LLM.generate`` on all requests at once (continuous batching), once per
  ``--steps`` value (``num_scheduler_steps``). The workload runs once untimed first
  (``--warmup workload``: compiles every shape it needs), then timed; ``--warmup ready``
  times a cold start's run instead (the ready set built, the rest in the background). Prefix caching is
  off so the timed pass gains nothing from the untimed one.
Each system (and each jaxpage configuration) runs in its own child process by default.

* ``hf``: ``transformers`` ``generate`` with static, left-padded batches (see
  ``bench_hf.py``), at ``--hf-batch-size`` or the best size a short probe predicts.

Reported per system: requests/s, output tokens/s, total tokens/s (prompt + output) and
the ratio to the Hugging Face row, as ``<out>/<stem>.json``, ``.md`` and ``.png``. With
``--profile``, jaxpage rows add the host/device split of ``LLMEngine.step`` (host time
per call, time spent waiting for results, the device's idle fraction, chained calls).

    python scripts/bench_throughput.py --workload sharegpt-like            # SmolLM2, CPU
    python scripts/bench_throughput.py --model llama3-8b --dtype bfloat16 \\
        --workload random --num-requests 500                               # a GPU
    python scripts/bench_throughput.py --model preset:tiny-llama --systems jaxpage \\
        --workload random --num-requests 64 --input-len 32 --output-len 128 \\
        --steps 1,8sync,8 --profile                     # multi-step, async scheduling
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import (Workload, environment, make_workload, markdown_table,  # noqa: E402
                          model_label, resolve_model, vocab_size_of, write_report)


def rates(workload: Workload, wall_s: float) -> dict[str, float]:
    n_in, n_out = workload.num_input_tokens, workload.num_output_tokens
    return {"wall_s": wall_s, "requests_per_s": len(workload.requests) / wall_s,
            "output_tokens_per_s": n_out / wall_s, "total_tokens_per_s": (n_in + n_out) / wall_s}


def jaxpage_engine_options(args, workload: Workload) -> dict:
    max_model_len = args.max_model_len or workload.max_total_len
    return dict(dtype=args.dtype, max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=False, attention_backend=args.attention_backend,
                **({"num_kv_blocks": args.num_kv_blocks} if args.num_kv_blocks else {}))


QUANTIZED_OPTIONS = ("", "int8", "int4", "gguf", "kv_int8", "kv_fp8", "kv_fp8_e5m2")


def run_jaxpage(args, model, workload: Workload, config: str, log) -> dict:
    """One engine configuration: "K" (``num_scheduler_steps``) or "Ksync" (the same with
    asynchronous scheduling turned off, on engines that have that option), optionally
    followed by ":int8", ":int4" or ":gguf" (weight quantization) or ":kv_int8",
    ":kv_fp8", ":kv_fp8_e5m2" (a byte KV cache)."""
    from jaxpage import LLM, SamplingParams

    steps, _, quantization = config.partition(":")
    num_steps = int(steps.removesuffix("sync"))
    extra = {"async_scheduling": False} if steps.endswith("sync") else {}
    if quantization.startswith("kv_"):
        extra["kv_cache_dtype"] = quantization[3:]
    elif quantization:
        extra["quantization"] = quantization
    began = time.perf_counter()
    warmup = {"buckets": True, "ready": "ready"}.get(args.warmup, False)
    llm = LLM(model, num_scheduler_steps=num_steps, warmup=warmup,
              **jaxpage_engine_options(args, workload), **extra)
    engine = llm.llm_engine
    load_s = time.perf_counter() - began
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
              for r in workload.requests]
    if args.warmup == "workload":
        log(f"jaxpage K={config}: untimed pass (compiles every shape of this workload)")
        llm.generate(prompts, params, use_tqdm=not args.no_progress)
    engine.step_profile.update({k: type(v)() for k, v in engine.step_profile.items()})
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    wall = time.perf_counter() - start
    made = [len(o.outputs[0].token_ids) for o in outs]
    wanted = [r.output_len for r in workload.requests]
    if made != wanted:
        raise RuntimeError("jaxpage generated a different number of tokens than requested")
    row = {"system": f"jaxpage (K={steps}{', ' + quantization if quantization else ''})",
           "num_scheduler_steps": num_steps, "config": config,
           "quantization": quantization or None, "weight_bytes": engine.weight_bytes,
           "load_s": load_s, "num_kv_blocks": engine.num_kv_blocks, **rates(workload, wall)}
    if args.profile:
        p = engine.step_profile
        calls = max(p["calls"], 1)
        busy = p["device_s"] + p["host_s"]
        row.update(engine_calls=p["calls"], host_ms_per_call=1e3 * p["host_s"] / calls,
                   wait_ms_per_call=1e3 * p["device_s"] / calls)
        if "idle_s" in p:  # asynchronous dispatch: the engine measures the device's idle time
            row.update(device_idle_fraction=p["idle_s"] / wall, chained_calls=p.get("chained"))
        else:              # synchronous calls: the device idles exactly while the host works
            row.update(device_idle_fraction=p["host_s"] / busy if busy else 0.0)
    del llm, engine
    return row


def add_roofline(args, row: dict, model, workload: Workload, device_kind: str) -> None:
    """Fraction of the decode memory roofline reached (see bench_roofline.py)."""
    import bench_roofline
    from jaxpage.models.loader import default_model_path, open_source
    from jaxpage.models.presets import preset_config
    from jaxpage.models.registry import resolve_architecture

    bandwidth = (args.peak_bandwidth_gbs * 1e9 if args.peak_bandwidth_gbs
                 else bench_roofline.peak_bandwidth(device_kind))
    if bandwidth is None:
        return
    if model is not None and model.startswith("preset:"):
        hf_config = preset_config(model)
    else:
        hf_config = open_source(model or default_model_path()).hf_config
    arch = resolve_architecture(hf_config)[1]
    summary = workload.summary()
    batch = min(args.max_num_seqs, len(workload.requests))
    context = summary["input_len_mean"] + summary["output_len_mean"] / 2
    roof = bench_roofline.roofline(arch, args.dtype, batch, context, bandwidth)
    row.update(roof, roofline_fraction=row["output_tokens_per_s"]
               / roof["roofline_output_tokens_per_s"])


def run_hf(args, model, workload: Workload, log) -> dict:
    import bench_hf

    began = time.perf_counter()
    hf = bench_hf.load_hf_model(model, args.dtype)
    load_s = time.perf_counter() - began
    probes = None
    if args.hf_batch_size == "auto":
        top = min(args.hf_max_batch_size, len(workload.requests))
        candidates = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b <= top] or [1]
        if top not in candidates:
            candidates.append(top)
        batch_size, probes = bench_hf.search_batch_size(hf, workload.requests, candidates, log)
    else:
        batch_size = int(args.hf_batch_size)
    result = bench_hf.run_static_batches(hf, workload.requests, batch_size,
                                         progress=not args.no_progress)
    del hf
    return {"system": f"hf generate (static batch {batch_size})", "load_s": load_s,
            "batch_size": batch_size, "batch_size_probes": probes,
            "generated_tokens_incl_padding": result["generated_tokens_incl_padding"],
            **rates(workload, result["wall_s"])}


COLUMNS = [("system", "system"), ("requests_per_s", "requests/s"),
           ("output_tokens_per_s", "output tokens/s"), ("total_tokens_per_s", "total tokens/s"),
           ("wall_s", "wall s"), ("ratio_vs_hf", "output tok/s vs HF"),
           ("ratio_vs_first", "vs first jaxpage row")]
PROFILE_COLUMNS = [("engine_calls", "engine calls"), ("host_ms_per_call", "host ms/call"),
                   ("wait_ms_per_call", "wait for results ms/call"),
                   ("device_idle_fraction", "device idle fraction"),
                   ("chained_calls", "chained calls")]


def plot(rows):
    def draw(ax):
        names = [r["system"] for r in rows]
        values = [r["output_tokens_per_s"] for r in rows]
        bars = ax.barh(names, values, color=["#d62728" if n.startswith("hf") else "#1f77b4"
                                              for n in names])
        for bar, row in zip(bars, rows):
            label = f"{row['output_tokens_per_s']:,.0f}"
            if row.get("ratio_vs_hf"):
                label += f"  ({row['ratio_vs_hf']:.1f}x HF)"
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + label,
                    va="center", fontsize=8)
        ax.set_xlabel("output tokens/s (higher is better)")
        ax.set_xlim(0, max(values) * 1.45)
        ax.invert_yaxis()
    return draw


def run_isolated(argv, system: str, steps: str | None, log) -> dict:
    """One system in a fresh child process (so JAX and PyTorch never share an accelerator's
    memory), returning its result row."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--systems", system,
               "--isolate", "no", "--out-dir", out, "--name", "cell", "--json", "",
               *(["--steps", str(steps)] if steps is not None else [])]
        log(f"running {system} in a child process")
        env = dict(os.environ)
        if system == "jaxpage":  # the engine sizes its KV cache from the device's memory
            env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
        return json.loads((Path(out) / "cell.json").read_text())["results"][0]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default",
                        help="'default' (embedded SmolLM2), a checkpoint dir or .gguf, or a "
                             "preset name (llama3-8b, llama3-1b, qwen2-7b, tiny-llama)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--workload", default="sharegpt-like",
                        help="name in configs/workloads/ or a TOML path")
    parser.add_argument("--num-requests", type=int, default=None, help="override the workload's")
    parser.add_argument("--input-len", type=int, default=None, help="fixed prompt length")
    parser.add_argument("--output-len", type=int, default=None, help="fixed output length")
    parser.add_argument("--seed", type=int, default=None, help="override the workload's seed")
    parser.add_argument("--systems", default="jaxpage,hf", help="comma list of jaxpage, hf")
    parser.add_argument("--steps", default="8",
                        help="jaxpage configurations: num_scheduler_steps values, each "
                             "optionally with 'sync' (asynchronous scheduling off) and "
                             "':int8', ':int4', ':gguf' (weight quantization) or "
                             "':kv_int8', ':kv_fp8', ':kv_fp8_e5m2' (KV cache), e.g. "
                             "8,8:int8,1:kv_fp8")
    parser.add_argument("--profile", action="store_true", help="report jaxpage's host/device split")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: the workload's longest prompt + output")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--warmup", default="workload",
                        choices=["workload", "buckets", "ready", "none"],
                        help="how jaxpage compiles before the timed pass: an untimed pass of "
                             "the workload, every program (buckets), the ready set with the "
                             "rest built in the background during the timed pass (ready, an "
                             "accelerator's default start), or nothing")
    parser.add_argument("--hf-batch-size", default="auto", help="an integer, or 'auto' (probe)")
    parser.add_argument("--hf-max-batch-size", type=int, default=64)
    parser.add_argument("--isolate", default="auto", choices=["auto", "yes", "no"],
                        help="each system in its own child process (auto: when more than one "
                             "runs, so that neither inherits the other's threads or, on an "
                             "accelerator, memory)")
    parser.add_argument("--peak-bandwidth-gbs", type=float, default=None,
                        help="memory bandwidth for the decode roofline (default: by device)")
    parser.add_argument("--out-dir", default="bench_results")
    parser.add_argument("--name", default=None, help="file stem (default: throughput-<workload>)")
    parser.add_argument("--json", default=None, help="also write the JSON here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in ("jaxpage", "hf")]
    if bad or not systems:
        parser.error(f"--systems={args.systems!r}: each must be 'jaxpage' or 'hf'")
    args.systems = systems
    args.steps = [k.strip() for k in args.steps.split(",") if k.strip()]
    if not args.steps or not all(
            k.partition(":")[0].removesuffix("sync").isdigit()
            and k.partition(":")[2] in QUANTIZED_OPTIONS for k in args.steps):
        parser.error(f"--steps={','.join(args.steps)!r} must be a comma list of integers, "
                     "each optionally followed by 'sync' and one of ':int8', ':int4', ':gguf', "
                     "':kv_int8', ':kv_fp8', ':kv_fp8_e5m2'")
    if args.hf_batch_size != "auto" and not args.hf_batch_size.isdigit():
        parser.error(f"--hf-batch-size={args.hf_batch_size!r} must be an integer or 'auto'")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.isolate != "no":  # this process must not reserve an accelerator's memory
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    log = (lambda msg: print(msg, file=sys.stderr, flush=True))
    model = resolve_model(args.model)
    workload = make_workload(args.workload, vocab_size_of(model), num_requests=args.num_requests,
                             input_len=args.input_len, output_len=args.output_len, seed=args.seed)
    log(f"workload {workload.name}: {len(workload.requests)} requests, "
        f"{workload.num_input_tokens} prompt + {workload.num_output_tokens} output tokens")
    env = environment()
    cells = [("jaxpage", k) for k in args.steps if "jaxpage" in args.systems]
    cells += [("hf", None)] if "hf" in args.systems else []
    isolate = args.isolate == "yes" or (args.isolate == "auto" and len(cells) > 1)
    rows = []
    for system, steps in cells:
        if isolate:
            rows.append(run_isolated(argv, system, steps, log))
        elif system == "jaxpage":
            rows.append(run_jaxpage(args, model, workload, steps, log))
        else:
            rows.append(run_hf(args, model, workload, log))
    for row in rows:
        if not row["system"].startswith("hf"):
            add_roofline(args, row, model, workload, env["device"])
    hf_rows = [r for r in rows if r["system"].startswith("hf")]
    first = next((r for r in rows if not r["system"].startswith("hf")), None)
    for row in rows:
        if hf_rows:
            row["ratio_vs_hf"] = row["output_tokens_per_s"] / hf_rows[0]["output_tokens_per_s"]
        if first is not None and not row["system"].startswith("hf") and len(args.steps) > 1:
            row["ratio_vs_first"] = row["output_tokens_per_s"] / first["output_tokens_per_s"]
    columns = COLUMNS + (PROFILE_COLUMNS if args.profile else [])
    if any("roofline_fraction" in r for r in rows):
        columns += [("roofline_output_tokens_per_s", "decode roofline tok/s"),
                    ("roofline_fraction", "fraction of roofline")]
    table = markdown_table(rows, columns)
    summary = workload.summary()
    payload = {"benchmark": "throughput", "environment": env, "isolated": isolate,
               "model": model_label(model), "dtype": args.dtype, "workload": summary,
               "engine_options": jaxpage_engine_options(args, workload), "results": rows}
    notes = (f"Model {model_label(model)}, {args.dtype}. Workload `{workload.name}`: "
             f"{summary['num_requests']} requests, {summary['input_tokens']} prompt tokens "
             f"(mean {summary['input_len_mean']:.0f}, max {summary['input_len_max']}), "
             f"{summary['output_tokens']} output tokens (mean {summary['output_len_mean']:.0f}, "
             f"max {summary['output_len_max']}), `ignore_eos`. Tokens/s count the tokens the "
             "requests asked for; Hugging Face static batches also compute padding tokens "
             "that are not counted.")
    stem = args.name or f"throughput-{workload.name}"
    paths = write_report(args.out_dir, stem, title=f"Offline throughput: {workload.name}",
                         payload=payload, table=table, notes=notes, plot=plot(rows))
    if args.json:
        Path(args.json).write_text(paths["json"].read_text())
    print(table)
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    return payload


if __name__ == "__main__":
    main()
