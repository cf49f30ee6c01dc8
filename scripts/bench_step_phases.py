#!/usr/bin/env python3
"""Where an offline run's time goes: prefill and decode, each against its own bound.

One engine (``LLM``, random weights for a preset) runs a fixed workload of ``N`` prompts
of ``--input-len`` token ids and ``--output-len`` output tokens (``ignore_eos``), after an
untimed pass that compiles what it needs:

* **prefill**: the same prompts with one output token each, timed; its bound is the
  step's FLOPs (every projection and the LM head over every prompt token, plus causal
  attention) at the bf16 matrix rate measured here (an 8192^3 product);
* **decode**: the full run's time less the prefill's; its bound is, for each of the
  ``output-len - 1`` decode steps, the weights plus every sequence's cached K / V read
  once, at the copy bandwidth measured here;
* **batch 1**: one prompt, decoded alone: time per output token against the weights
  read once per token at that bandwidth (the weights floor);
* the device's idle fraction during the full run (the engine's own step profile), for
  greedy rows and again for top-p rows (``--top-p``: the program that does the optional
  sampling work).

With ``--trace-dir`` a short run (8 prompts of 16 output tokens) is also traced with
``jax.profiler`` there, and the device time by kernel in it is printed.

    python scripts/bench_step_phases.py --model preset:llama3-8b --dtype bfloat16 \\
        --json out/phases.json                                      # a GPU
    python scripts/bench_step_phases.py --model preset:tiny-llama --num-requests 4 \\
        --input-len 32 --output-len 8 --batch1-output 8             # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import bench_roofline  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="preset:llama3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="the engine's batch limit (default: --num-requests); batch 1 alone "
                        "under a serving engine's limit: --num-requests 1 --max-num-seqs 64 "
                        "--output-len 2 --top-p 0")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--num-scheduler-steps", type=int, default=8)
    p.add_argument("--batch1-output", type=int, default=128,
                   help="output tokens of the batch-1 run (0: skip it)")
    p.add_argument("--top-p", type=float, default=0.9,
                   help="also time the full run with top-p sampling (0: skip)")
    p.add_argument("--trace-dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def measured_ceilings() -> tuple[float, float]:
    """(copy bytes/s, bf16 matmul FLOP/s) on the default device, back-to-back calls."""
    def rate(fn, work, calls):
        jax.block_until_ready(fn())
        start = time.perf_counter()
        jax.block_until_ready([fn() for _ in range(calls)])
        return work * calls / (time.perf_counter() - start)

    small = jax.default_backend() == "cpu"
    n = (64 if small else 1024) * 2**20 // 4
    x = jnp.arange(n, dtype=jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    m = 1024 if small else 8192
    a = jax.random.normal(jax.random.PRNGKey(0), (m, m), jnp.bfloat16)
    matmul = jax.jit(lambda a, b: a @ b)
    return rate(lambda: copy(x), 8 * n, 20), rate(lambda: matmul(a, a), 2 * m**3, 10)


def prefill_flops(arch, tokens_per_seq: int, seqs: int) -> float:
    """Projections and LM head (2 FLOPs a weight a token) and causal attention."""
    h, i = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    weights = arch.num_layers * per_layer + arch.vocab_size * h
    tokens = tokens_per_seq * seqs
    pairs = seqs * tokens_per_seq * (tokens_per_seq + 1) / 2
    attention = 4 * arch.num_layers * arch.num_heads * arch.head_dim * pairs
    return 2 * weights * tokens + attention


def decode_bound_s(weight_bytes: int, kv_per_token: int, seqs: int, input_len: int,
                   output_len: int, bandwidth: float) -> float:
    """Sum over the decode steps of (weights + every sequence's cache) / bandwidth."""
    total = 0.0
    for step in range(1, output_len):
        total += (weight_bytes + seqs * (input_len + step) * kv_per_token) / bandwidth
    return total


def device_timeline(events: list, device_pids: set) -> dict:
    """When the device ran kernels, from a Perfetto trace's events: the kernels (complete
    events of the device processes' stream threads; every device thread when none is
    named ``Stream...``), the span from the first kernel's start to the last one's end,
    the time at least one kernel ran (the union of their intervals, so streams that
    overlap count once), and the idle gaps between them. A step slower than its bound
    with the device busy most of the span is slow kernels; one with many short gaps is
    launches (each kernel's fixed cost), which fewer, larger kernels or CUDA graphs cut."""
    names = {(e.get("pid"), e.get("tid")): str(e.get("args", {}).get("name", ""))
             for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    on_device = [e for e in events if e.get("ph") == "X" and e.get("pid") in device_pids]
    streams = [e for e in on_device
               if names.get((e.get("pid"), e.get("tid")), "").startswith("Stream")]
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
                   for e in (streams or on_device))
    if not spans:
        return {}
    busy, gaps, end = 0.0, [], spans[0][0]
    for start, stop in spans:
        if start > end:
            gaps.append(start - end)
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = end - spans[0][0]
    return dict(kernels=len(spans), span_s=span / 1e6, busy_s=busy / 1e6,
                busy_fraction=busy / span if span else None, gaps=len(gaps),
                gap_s=sum(gaps) / 1e6, mean_gap_us=sum(gaps) / len(gaps) if gaps else 0.0)


def _device_pids(events: list) -> set:
    return {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") ==
            "process_name" and any(k in str(e.get("args", {}).get("name", ""))
                                   for k in ("GPU", "TPU", "/device:"))}


def _trace_events(trace_dir: Path) -> tuple[Path, list] | None:
    """(the newest Perfetto trace file under ``trace_dir``, its events), or None."""
    import gzip

    files = sorted(trace_dir.rglob("*.trace.json.gz"))
    if not files:
        return None
    trace = json.loads(gzip.open(files[-1]).read())
    return files[-1], trace["traceEvents"] if isinstance(trace, dict) else trace


def trace_summary(trace_dir: Path, top: int = 12) -> dict:
    """Device time by kernel name in the Perfetto trace ``jax.profiler`` wrote (the events
    of the processes named for a GPU / TPU device), the ``top`` largest."""
    found = _trace_events(trace_dir)
    if found is None:
        return {}
    path, events = found
    device_pids = _device_pids(events)
    by_name: dict[str, float] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device_pids:
            by_name[e["name"]] = by_name.get(e["name"], 0.0) + float(e.get("dur", 0)) / 1e6
    total = sum(by_name.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return dict(file=str(path), device_s=total,
                kernels=[dict(name=n[:120], s=t, fraction=t / total if total else 0.0)
                         for n, t in ranked],
                timeline=device_timeline(events, device_pids))


def run(llm, prompts, output_len: int, top_p: float | None = None) -> dict:
    from jaxpage import SamplingParams

    sampling = (dict(temperature=1.0, top_p=top_p, seed=0) if top_p else dict(temperature=0))
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, **sampling)
    engine = llm.llm_engine
    engine.step_profile.update({k: type(v)() for k, v in engine.step_profile.items()})
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    made = sum(len(o.outputs[0].token_ids) for o in outs)
    if made != output_len * len(prompts):
        raise RuntimeError(f"made {made} tokens, wanted {output_len * len(prompts)}")
    p = engine.step_profile
    row = dict(wall_s=wall, calls=p.get("calls"))
    if "idle_s" in p:
        row["device_idle_fraction"] = p["idle_s"] / wall
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxpage import LLM
    from bench_common import resolve_model

    model = resolve_model(args.model)
    device = jax.devices()[0]
    print(f"device: {device.device_kind}, jax {jax.__version__}", flush=True)
    bandwidth, matmul = measured_ceilings()
    print(f"copy {bandwidth / 1e9:.0f} GB/s, bf16 matmul {matmul / 1e12:.0f} TFLOP/s", flush=True)
    began = time.perf_counter()
    max_num_seqs = args.max_num_seqs or args.num_requests
    llm = LLM(model, dtype=args.dtype, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.input_len + max(args.output_len, args.batch1_output),
              num_scheduler_steps=args.num_scheduler_steps, enable_prefix_caching=False,
              warmup=False)
    engine = llm.llm_engine
    load_s = time.perf_counter() - began
    rng = np.random.default_rng(0)
    vocab = engine.arch.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(10, vocab - 10, args.input_len).tolist()}
               for _ in range(args.num_requests)]
    began = time.perf_counter()
    run(llm, prompts, args.output_len)                       # untimed: compiles
    if args.batch1_output:
        run(llm, prompts[:1], args.batch1_output)
    compile_s = time.perf_counter() - began
    print(f"loaded in {load_s:.0f} s, untimed passes {compile_s:.0f} s", flush=True)

    weights, kv_per_token = bench_roofline.decode_bytes(engine.arch, args.dtype)
    result = dict(device=device.device_kind, jax=jax.__version__, model=args.model,
                  dtype=args.dtype, copy_bytes_per_s=bandwidth, matmul_flops_per_s=matmul,
                  weight_bytes=weights, kv_bytes_per_token=kv_per_token, load_s=load_s,
                  untimed_passes_s=compile_s,
                  workload=dict(requests=args.num_requests, input_len=args.input_len,
                                output_len=args.output_len,
                                max_num_seqs=max_num_seqs),
                  xla_flags=os.environ.get("XLA_FLAGS", ""))

    def save():  # after every measurement: a run stopped by a time limit keeps what it has
        if args.json:
            args.json.write_text(json.dumps(result, indent=1, default=str))

    prefill = run(llm, prompts, 1)
    full = run(llm, prompts, args.output_len)
    pf_flops = prefill_flops(engine.arch, args.input_len, args.num_requests)
    pf_bound = pf_flops / matmul
    dec_s = full["wall_s"] - prefill["wall_s"]
    dec_bound = decode_bound_s(weights, kv_per_token, args.num_requests, args.input_len,
                               args.output_len, bandwidth)
    result.update(full=full, prefill=prefill, prefill_flops=pf_flops, prefill_bound_s=pf_bound,
                  prefill_fraction_of_bound=pf_bound / prefill["wall_s"],
                  decode_s=dec_s, decode_bound_s=dec_bound,
                  decode_fraction_of_bound=dec_bound / dec_s if dec_s > 0 else None,
                  output_tokens_per_s=args.num_requests * args.output_len / full["wall_s"])
    save()
    print()
    print("| phase | time (s) | bound (s) | of bound | what bounds it |")
    print("|---|---|---|---|---|")
    print(f"| prefill ({args.num_requests} x {args.input_len}) | {prefill['wall_s']:.3f} | "
          f"{pf_bound:.3f} | {100 * result['prefill_fraction_of_bound']:.1f}% | "
          f"{pf_flops / 1e12:.1f} TFLOP at {matmul / 1e12:.0f} TFLOP/s |")
    if dec_s > 0:
        print(f"| decode ({args.output_len - 1} steps) | {dec_s:.3f} | {dec_bound:.3f} | "
              f"{100 * result['decode_fraction_of_bound']:.1f}% | weights + KV at "
              f"{bandwidth / 1e9:.0f} GB/s |")
    print(f"full run: {result['output_tokens_per_s']:.0f} output tok/s, device idle "
          f"{100 * full.get('device_idle_fraction', float('nan')):.1f}%", flush=True)
    if args.batch1_output:
        one_pf = run(llm, prompts[:1], 1)
        one = run(llm, prompts[:1], args.batch1_output)
        per_token = (one["wall_s"] - one_pf["wall_s"]) / (args.batch1_output - 1)
        floor = weights / bandwidth
        result.update(batch1_ms_per_token=1e3 * per_token, weights_floor_ms=1e3 * floor,
                      batch1_over_floor=per_token / floor, batch1=one)
        save()
        print(f"batch 1: {1e3 * per_token:.2f} ms a token, weights floor {1e3 * floor:.2f} ms "
              f"({per_token / floor:.2f}x), device idle "
              f"{100 * one.get('device_idle_fraction', float('nan')):.1f}%", flush=True)
    if args.top_p:
        run(llm, prompts, args.output_len, top_p=args.top_p)  # untimed: compiles
        result["full_top_p"] = top = run(llm, prompts, args.output_len, top_p=args.top_p)
        save()
        print(f"top-p {args.top_p}: {top['wall_s']:.3f} s "
              f"({args.num_requests * args.output_len / top['wall_s']:.0f} output tok/s), "
              f"device idle {100 * top.get('device_idle_fraction', float('nan')):.1f}%",
              flush=True)
    if args.trace_dir:
        try:
            with jax.profiler.trace(str(args.trace_dir)):
                run(llm, prompts[:8], min(16, args.output_len))
            result["trace"] = trace_summary(args.trace_dir)
            if args.batch1_output:  # batch 1 alone: are its steps kernels, or launches?
                one_dir = args.trace_dir / "batch1"
                with jax.profiler.trace(str(one_dir)):
                    run(llm, prompts[:1], args.batch1_output)
                result["trace_batch1"] = summary = trace_summary(one_dir)
                timeline = summary.get("timeline") or {}
                if timeline:
                    timeline["kernels_per_output_token"] = (timeline["kernels"]
                                                            / args.batch1_output)
                    print(f"batch 1 traced: {timeline['kernels']} kernels "
                          f"({timeline['kernels_per_output_token']:.0f} an output token, "
                          f"the prompt's step included), device busy "
                          f"{100 * (timeline['busy_fraction'] or 0):.1f}% of their span, "
                          f"{timeline['gaps']} gaps of {timeline['mean_gap_us']:.1f} us on "
                          f"average", flush=True)
        except Exception as error:  # noqa: BLE001 - the trace is extra
            result["trace_error"] = f"{type(error).__name__}: {error}"
        save()
    for k in result.get("trace", {}).get("kernels", []):
        print(f"  traced: {100 * k['fraction']:5.1f}%  {k['s'] * 1e3:8.2f} ms  {k['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
