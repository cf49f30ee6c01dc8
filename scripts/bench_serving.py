#!/usr/bin/env python3
"""Online serving benchmark against any OpenAI-compatible endpoint (streaming).

Requests from a workload (``configs/workloads/``) are sent to ``/v1/completions`` with
``stream: true``, at each request rate of ``--request-rates`` with Poisson arrivals
(exponential gaps, seeded; ``inf`` sends all at once), optionally capped at
``--max-concurrency`` requests in flight; or at a fixed concurrency alone
(``--request-rates inf --max-concurrency N``). Prompts are random token ids (the OpenAI
API accepts a list of integers as ``prompt``) or, with ``--prompt-format text``, words.
``ignore_eos`` and ``min_tokens`` (vLLM's extensions, which jaxpage follows) make every
request produce its workload length; ``--no-extensions`` leaves them out.

Measured per rate (see ``bench_serving_metrics.py`` for the definitions): TTFT, TPOT, ITL
and end-to-end latency (mean, median, p99), request and token throughput, and goodput
under ``--slo-ttft-ms`` / ``--slo-tpot-ms`` / ``--slo-e2el-ms``. If the server exposes
Prometheus ``/metrics`` with vLLM-named latency histograms, their means over the same
run are reported beside the client's, as a cross-check.

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 \\
        --workload sharegpt-like --num-prompts 64 --request-rates 1,2,4 --slo-ttft-ms 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (BenchRequest, Workload, environment, make_workload,  # noqa: E402
                          markdown_table, write_report)
from bench_serving_metrics import RequestRecord, metrics_delta, summarize  # noqa: E402

WORDS = ("time person year way day thing man world life hand part child eye woman place "
         "work week case point number group problem fact").split()


def prompt_of(request: BenchRequest, fmt: str):
    if fmt == "tokens":
        return request.prompt_token_ids
    return " ".join(WORDS[t % len(WORDS)] for t in request.prompt_token_ids)


def request_body(args, model: str, request: BenchRequest) -> dict:
    body = {"model": model, "prompt": prompt_of(request, args.prompt_format),
            "max_tokens": request.output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if not args.no_extensions:
        body.update(ignore_eos=True, min_tokens=request.output_len)
    return body


async def send_one(client, url: str, body: dict, record: RequestRecord) -> None:
    """Stream one completion, recording the time of every chunk that carries text."""
    record.sent = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:200]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("error"):
                    record.error = str(event["error"])[:200]
                    return
                usage = event.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    record.output_tokens = int(usage["completion_tokens"])
                for choice in event.get("choices") or []:
                    text = choice.get("text")
                    if text is None:
                        text = (choice.get("delta") or {}).get("content")
                    if text:
                        record.chunk_times.append(time.perf_counter())
                        chunks += 1
    except Exception as exc:  # a failed request is counted, not fatal
        record.error = f"{type(exc).__name__}: {exc}"[:200]
        return
    if record.output_tokens == 0:
        record.output_tokens = chunks
    if not record.chunk_times and record.error is None:
        record.error = "no content streamed"


async def run_rate(args, model: str, workload: Workload, rate: float) -> tuple[list, float]:
    """Send the whole workload at ``rate`` requests/s (Poisson); returns records, duration."""
    import httpx
    from tqdm.auto import tqdm

    rng = np.random.default_rng(args.seed)
    gaps = (np.zeros(len(workload.requests)) if math.isinf(rate)
            else rng.exponential(1.0 / rate, len(workload.requests)))
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    records = [RequestRecord(r.prompt_len, r.output_len) for r in workload.requests]
    url = args.base_url.rstrip("/") + args.endpoint
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    bar = tqdm(total=len(records), desc=f"rate {rate:g}/s", disable=args.no_progress,
               dynamic_ncols=True)

    async def guarded(client, request, record):
        if limit is None:
            await send_one(client, url, request_body(args, model, request), record)
        else:
            async with limit:
                await send_one(client, url, request_body(args, model, request), record)
        bar.update(1)

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        tasks = []
        began = time.perf_counter()
        for gap, request, record in zip(gaps, workload.requests, records):
            if gap > 0:
                await asyncio.sleep(float(gap))
            tasks.append(asyncio.create_task(guarded(client, request, record)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - began
    bar.close()
    return records, duration


def fetch_text(url: str | None) -> str | None:
    if not url:
        return None
    import httpx

    try:
        response = httpx.get(url, timeout=10.0)
        return response.text if response.status_code == 200 else None
    except httpx.HTTPError:
        return None


def served_model(args) -> str:
    if args.model:
        return args.model
    import httpx

    response = httpx.get(args.base_url.rstrip("/") + "/v1/models", timeout=30.0)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{args.base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


COLUMNS = [("request_rate", "rate (req/s)"), ("max_concurrency", "max conc."),
           ("completed", "ok"), ("failed", "failed"),
           ("request_throughput", "req/s"), ("output_throughput", "out tok/s"),
           ("total_token_throughput", "total tok/s"),
           ("mean_ttft_ms", "TTFT mean ms"), ("median_ttft_ms", "TTFT median"),
           ("p99_ttft_ms", "TTFT p99"),
           ("mean_tpot_ms", "TPOT mean ms"), ("median_tpot_ms", "TPOT median"),
           ("p99_tpot_ms", "TPOT p99"),
           ("mean_itl_ms", "ITL mean ms"), ("median_itl_ms", "ITL median"), ("p99_itl_ms", "ITL p99"),
           ("mean_e2el_ms", "E2E mean ms"), ("median_e2el_ms", "E2E median"),
           ("p99_e2el_ms", "E2E p99"), ("goodput", "goodput req/s")]
SERVER_COLUMNS = [("request_rate", "rate (req/s)"), ("mean_ttft_ms", "client TTFT mean ms"),
                  ("server_mean_ttft_ms", "/metrics TTFT mean ms"),
                  ("mean_e2el_ms", "client E2E mean ms"),
                  ("server_mean_e2el_ms", "/metrics E2E mean ms"),
                  ("mean_tpot_ms", "client TPOT mean ms"),
                  ("server_mean_tpot_ms", "/metrics TPOT mean ms")]


def plot(rows):
    def draw(ax):
        x = [r["output_throughput"] for r in rows]
        ax.plot(x, [r["mean_ttft_ms"] for r in rows], "o-", label="TTFT mean")
        ax.plot(x, [r["p99_ttft_ms"] for r in rows], "o--", label="TTFT p99")
        ax.plot(x, [r["mean_e2el_ms"] for r in rows], "s-", label="E2E mean")
        ax.plot(x, [r["mean_tpot_ms"] for r in rows], "^-", label="TPOT mean")
        for r, xi in zip(rows, x):
            ax.annotate(f"{r['request_rate']:g}/s", (xi, r["mean_e2el_ms"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("output tokens/s achieved")
        ax.set_ylabel("latency (ms)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.set_title("latency vs throughput across request rates", fontsize=9)
    return draw


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", default=None, help="model name to send (default: /v1/models' first)")
    parser.add_argument("--workload", default="sharegpt-like")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--input-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=4000,
                        help="random prompt ids are drawn below this (fits every preset)")
    parser.add_argument("--prompt-format", choices=["tokens", "text"], default="tokens")
    parser.add_argument("--no-extensions", action="store_true",
                        help="do not send ignore_eos / min_tokens")
    parser.add_argument("--request-rates", default="1,2,4", help="comma list; 'inf' = all at once")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-tpot-ms", type=float, default=None)
    parser.add_argument("--slo-e2el-ms", type=float, default=None)
    parser.add_argument("--metrics-url", default=None, help="default: <base-url>/metrics; 'none' skips")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--out-dir", default="bench_results")
    parser.add_argument("--name", default="serving")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        args.request_rates = [float(r) for r in args.request_rates.split(",")]
    except ValueError:
        parser.error(f"--request-rates={args.request_rates!r} must be numbers or 'inf'")
    if any(not r > 0 for r in args.request_rates):
        parser.error(f"--request-rates={args.request_rates}: each must be > 0 (or inf)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error(f"--max-concurrency={args.max_concurrency} must be at least 1")
    if args.metrics_url is None:
        args.metrics_url = args.base_url.rstrip("/") + "/metrics"
    elif args.metrics_url == "none":
        args.metrics_url = None
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    workload = make_workload(args.workload, args.vocab_size, num_requests=args.num_prompts,
                             input_len=args.input_len, output_len=args.output_len, seed=args.seed)
    model = served_model(args)
    slo = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms, "e2el": args.slo_e2el_ms}
    rows = []
    for rate in args.request_rates:
        before = fetch_text(args.metrics_url)
        records, duration = asyncio.run(run_rate(args, model, workload, rate))
        row = {"request_rate": rate, "max_concurrency": args.max_concurrency,
               **summarize(records, duration, slo)}
        row.update(metrics_delta(before, fetch_text(args.metrics_url)) or {})
        rows.append(row)
    table = markdown_table(rows, COLUMNS)
    if any("server_mean_ttft_ms" in r or "server_mean_e2el_ms" in r for r in rows):
        table += "\n\nClient-side means against the server's `/metrics` histograms:\n\n"
        table += markdown_table(rows, SERVER_COLUMNS)
    summary = workload.summary()
    payload = {"benchmark": "serving", "environment": environment(), "base_url": args.base_url,
               "endpoint": args.endpoint, "model": model, "workload": summary,
               "slo_ms": slo, "results": rows}
    notes = (f"Endpoint {args.base_url}{args.endpoint}, model `{model}`. Workload "
             f"`{workload.name}`: {summary['num_requests']} requests per rate, "
             f"{summary['input_tokens']} prompt and {summary['output_tokens']} output tokens "
             f"wanted. Poisson arrivals (seed {args.seed}). SLOs (ms): "
             + ", ".join(f"{k} <= {v:g}" for k, v in slo.items() if v is not None) + ".")
    paths = write_report(args.out_dir, args.name, title="Online serving", payload=payload,
                         table=table, notes=notes, plot=plot(rows))
    print(table)
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    return payload


if __name__ == "__main__":
    main()
