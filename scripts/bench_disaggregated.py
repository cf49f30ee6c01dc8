"""Disaggregated prefill/decode against one colocated instance, under prompt bursts.

Two set-ups of the same model, run one after the other on this machine:

* **colocated**: one ``jaxpage serve`` pinned to every core (``taskset``);
* **disaggregated**: a prefill instance pinned to the first half of the cores, a decode
  instance to the other half, ``jaxpage proxy``'s app in this process in front.

The workload: ``--decoders`` clients each stream short-prompt completions back to back
(a steady stream of decodes), and every ``--burst-every`` seconds a burst of
``--burst-size`` long prompts (~``--long-tokens`` tokens of this repository's docs)
arrives. Measured per set-up: time to first token of both kinds, inter-token latency
(the gaps between streamed chunks of the steady clients) at p50 and p99, and output
tokens/s (counted from each answer's ``usage``). Both set-ups run the same engine options;
``--num-scheduler-steps`` (default 1) sets how many decode iterations one device call
runs, and so how many tokens a streamed chunk carries: at 8 a chunk holds up to 8 tokens
and its gap is 8 iterations long. Then the KV transfer itself, in this process between a prefill and a decode
engine: seconds and bandwidth per request against prompt length.

    python scripts/bench_disaggregated.py                   # SmolLM2, 40 s per set-up
    python scripts/bench_disaggregated.py --duration 20 --model preset:tiny-llama
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import ROOT, environment, markdown_table, resolve_model, write_report  # noqa: E402

MODEL_NAME = "bench-model"


def long_prompt(tokens: int, offset: int) -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    words = text.split()
    start = (offset * 97) % max(1, len(words) - tokens)
    return " ".join(words[start:start + int(tokens * 0.75)])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def stream_one(http, prompt: str, max_tokens: int) -> tuple[float, list[float], int, int]:
    """(TTFT, gaps between later chunks, chunks, completion tokens) of one streamed
    completion."""
    import json

    start = time.perf_counter()
    first, last, gaps, chunks, tokens = None, None, [], 0, 0
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if not event["choices"] or not event["choices"][0]["text"]:
                continue
            now = time.perf_counter()
            chunks += 1
            if first is None:
                first = now - start
            else:
                gaps.append(now - last)
            last = now
    return first or float("nan"), gaps, chunks, tokens


async def workload(base_url: str, args) -> dict:
    import httpx

    stop_at = time.perf_counter() + args.duration
    steady_ttft, long_ttft, gaps, tokens = [], [], [], [0]
    steady = [0, 0]  # the steady clients' (tokens, chunks)

    async with httpx.AsyncClient(base_url=base_url, timeout=600,
                                 limits=httpx.Limits(max_connections=256)) as http:
        async def decoder(i: int) -> None:
            n = 0
            while time.perf_counter() < stop_at:
                ttft, g, chunks, n_tokens = await stream_one(
                    http, f"Client {i} request {n}: count on:", args.decode_tokens)
                steady_ttft.append(ttft)
                gaps.extend(g)
                tokens[0] += n_tokens
                steady[0] += n_tokens
                steady[1] += chunks
                n += 1

        async def bursts() -> None:
            b = 0
            while time.perf_counter() + args.burst_every < stop_at:
                await asyncio.sleep(args.burst_every)

                async def one(j: int) -> None:
                    ttft, _, _, n_tokens = await stream_one(
                        http, long_prompt(args.long_tokens, b * args.burst_size + j), 8)
                    long_ttft.append(ttft)
                    tokens[0] += n_tokens
                await asyncio.gather(*[one(j) for j in range(args.burst_size)])
                b += 1

        began = time.perf_counter()
        await asyncio.gather(*[decoder(i) for i in range(args.decoders)], bursts())
        elapsed = time.perf_counter() - began
    return {"steady_ttft_p50_ms": 1e3 * percentile(steady_ttft, 50),
            "long_ttft_p50_ms": 1e3 * percentile(long_ttft, 50),
            "long_ttft_p99_ms": 1e3 * percentile(long_ttft, 99),
            "itl_p50_ms": 1e3 * percentile(gaps, 50), "itl_p99_ms": 1e3 * percentile(gaps, 99),
            "output_tok_s": tokens[0] / elapsed, "long_requests": len(long_ttft),
            "tokens_per_chunk": steady[0] / max(1, steady[1])}


def start(args_list: list[str], role: str | None, cores: str):
    from jaxpage.server.launch import free_port

    port = free_port()
    command = ["taskset", "-c", cores, sys.executable, "-m", "jaxpage.cli", "serve", *args_list,
               "--port", str(port), "--log-level", "warning", "--served-model-name", MODEL_NAME]
    if role:
        command += ["--kv-role", role]
    import subprocess

    return subprocess.Popen(command), f"http://127.0.0.1:{port}"


def run_setup(name: str, args, instance_args: list[str], cores: list[str]) -> dict:
    from jaxpage.server.proxy.disaggregated import wait_healthy
    from jaxpage.server.launch import BackgroundServer
    from jaxpage.server.proxy.app import build_proxy_app

    processes, proxy = [], None
    try:
        if name == "colocated":
            process, url = start(instance_args, None, ",".join(cores))
            processes.append(process)
            wait_healthy([url], processes, 600)
            base = url
        else:
            half = len(cores) // 2
            p_proc, p_url = start(instance_args, "prefill", ",".join(cores[:half]))
            d_proc, d_url = start(instance_args, "decode", ",".join(cores[half:]))
            processes += [p_proc, d_proc]
            wait_healthy([p_url, d_url], processes, 600)
            proxy = BackgroundServer(build_proxy_app([p_url], [d_url])).start()
            base = proxy.url
        warm = argparse.Namespace(**{**vars(args), "duration": min(15.0, args.duration)})
        asyncio.run(workload(base, warm))  # untimed: compiles the shapes the run needs
        row = asyncio.run(workload(base, args))
        return {"setup": name, **row}
    finally:
        if proxy is not None:
            proxy.stop()
        for process in processes:
            process.terminate()
            process.wait(30)


def transfer_rows(model: str | None, lengths: list[int]) -> list[dict]:
    """Offer + pull + install time per request against prompt length, two engines here."""
    from jaxpage import LLM, SamplingParams
    from jaxpage.runtime.kv_transfer import TransferTicket

    options = dict(max_model_len=max(lengths) + 64, max_num_seqs=4, warmup=False,
                   enable_prefix_caching=False, num_kv_blocks=2 * (max(lengths) // 16 + 8),
                   swap_space=0.5)
    prefill = LLM(model, kv_role="prefill", **options).llm_engine
    decode = LLM(model, kv_role="decode", **options).llm_engine
    rows = []
    for round_ in range(2):  # the first round compiles
        for n in lengths:
            rid = f"t{round_}-{n}"
            prefill.add_validated_request(prefill.make_request(
                rid, {"prompt_token_ids": [5 + i % 1000 for i in range(n)]},
                SamplingParams(max_tokens=1, temperature=0), kv_transfer={"do_remote_decode": True}))
            began = time.perf_counter()
            ticket = None
            while prefill.has_unfinished_requests():
                for output in prefill.step():
                    if output.finished:
                        ticket = output.kv_transfer_params
            offered = time.perf_counter()
            pages = decode.pull_kv(TransferTicket.from_dict(ticket))
            request = decode.make_request("d" + rid, None, SamplingParams(max_tokens=2),
                                          kv_transfer=ticket)
            decode.add_prefilled(request, pages, ticket)
            pulled = time.perf_counter()
            decode.abort_request("d" + rid)
            if round_:
                size = 2 * pages[0].nbytes
                rows.append({"prompt_tokens": n, "blocks": ticket["num_blocks"],
                             "kv_mib": size / 2**20, "prefill_and_offer_ms": 1e3 * (offered - began),
                             "pull_and_install_ms": 1e3 * (pulled - offered),
                             "gb_s": size / (pulled - offered) / 1e9})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds per set-up")
    parser.add_argument("--decoders", type=int, default=6)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--burst-every", type=float, default=5.0)
    parser.add_argument("--burst-size", type=int, default=3)
    parser.add_argument("--long-tokens", type=int, default=400)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--transfer-lengths", default="16,64,256,1024")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-scheduler-steps", type=int, default=1,
                        help="decode iterations per device call, on every instance")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    parser.add_argument("--stem", default="disaggregated")
    args = parser.parse_args(argv)

    model = resolve_model(args.model)
    instance_args = ([model] if model else []) + [
        "--max-num-seqs", "32", "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-model-len", str(args.max_model_len), "--swap-space", "1",
        "--num-scheduler-steps", str(args.num_scheduler_steps)]
    cores = [str(c) for c in sorted(os.sched_getaffinity(0))]
    rows = [run_setup(name, args, instance_args, cores) for name in ("colocated", "disaggregated")]
    for row in rows:
        print(f"{row['setup']}: ITL p50 {row['itl_p50_ms']:.0f} ms, p99 {row['itl_p99_ms']:.0f} ms; "
              f"long-prompt TTFT p50 {row['long_ttft_p50_ms']:.0f} ms; "
              f"{row['output_tok_s']:.1f} output tok/s", flush=True)
    transfers = transfer_rows(model, [int(x) for x in args.transfer_lengths.split(",")])
    for t in transfers:
        print(f"transfer {t['prompt_tokens']:5d} tokens: {t['kv_mib']:.2f} MiB, pull + install "
              f"{t['pull_and_install_ms']:.1f} ms ({t['gb_s']:.2f} GB/s)", flush=True)
    columns = [("setup", "set-up"), ("itl_p50_ms", "ITL p50 ms"), ("itl_p99_ms", "ITL p99 ms"),
               ("steady_ttft_p50_ms", "steady TTFT p50 ms"),
               ("long_ttft_p50_ms", "long-prompt TTFT p50 ms"),
               ("long_ttft_p99_ms", "long-prompt TTFT p99 ms"),
               ("output_tok_s", "output tok/s"), ("tokens_per_chunk", "tokens per chunk"),
               ("long_requests", "long prompts")]
    table = markdown_table(rows, columns)
    transfer_table = markdown_table(transfers, [
        ("prompt_tokens", "prompt tokens"), ("blocks", "blocks"), ("kv_mib", "KV MiB"),
        ("prefill_and_offer_ms", "prefill + offer ms"),
        ("pull_and_install_ms", "pull + install ms"), ("gb_s", "GB/s")])
    notes = ("Colocated: one instance on cores " + ",".join(cores) + "; disaggregated: prefill "
             "and decode instances on half the cores each, the proxy in the benchmark process. "
             f"Every instance: --num-scheduler-steps {args.num_scheduler_steps}, "
             f"--max-num-batched-tokens {args.max_num_batched_tokens}. "
             f"{args.decoders} clients stream {args.decode_tokens}-token completions back to "
             f"back; every {args.burst_every:.0f} s, {args.burst_size} prompts of "
             f"~{args.long_tokens} tokens arrive. {args.duration:.0f} s per set-up after a "
             "15 s untimed pass.\n\nKV transfer between two engines in one process (loopback "
             "transfer server), per request:\n\n" + transfer_table)

    def plot(ax):
        names = [r["setup"] for r in rows]
        ax.bar([n + " p50" for n in names], [r["itl_p50_ms"] for r in rows])
        ax.bar([n + " p99" for n in names], [r["itl_p99_ms"] for r in rows])
        ax.set_ylabel("inter-token latency, ms")
        ax.set_title("Steady decodes under prompt bursts")

    payload = {"environment": environment(), "model": model or "SmolLM2-135M-Instruct (GGUF)",
               "settings": vars(args), "rows": rows, "transfers": transfers}
    paths = write_report(args.out, args.stem, title="Disaggregated prefill/decode vs colocated",
                         payload=payload, table=table, notes=notes, plot=plot)
    print(table)
    print(notes)
    print("wrote", ", ".join(str(p) for p in paths.values()))
    return payload


if __name__ == "__main__":
    main()
