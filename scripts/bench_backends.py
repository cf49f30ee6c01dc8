#!/usr/bin/env python3
"""The same jaxpage workload on every JAX backend present and on each attention path.

Backends (``cpu``, ``gpu``, ``tpu``) are probed in child processes with ``JAX_PLATFORMS``
set, so probing a GPU does not reserve its memory here. For each backend found, the
workload runs through ``bench_throughput.py --systems jaxpage`` in a fresh child process
per attention path:

* ``kernel`` (alias ``pallas``): the platform's own attention kernel: the compiled Pallas
  kernel on a GPU or TPU (``attention_backend`` ``gpu`` / ``tpu``), the C++ FFI kernel on
  the CPU (``cpu``; Pallas runs there only in interpret mode, a correctness tool).
* ``reference``: the plain-jnp ragged paged attention.

One table (``<out>/backends.md``, ``.json``, ``.png``) holds every cell.

    python scripts/bench_backends.py --model default --workload sharegpt-like --num-requests 16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import ROOT, environment, markdown_table, write_report  # noqa: E402

PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}  # our name -> JAX_PLATFORMS value
KERNEL_BACKEND = {"cpu": "cpu", "gpu": "gpu", "tpu": "tpu"}  # the platform's own kernel


def child_env(platform: str) -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS=PLATFORMS[platform])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def probe(platform: str) -> str | None:
    """The device kind of ``platform`` if JAX can use it here, else None."""
    code = "import jax; d = jax.devices(); print(f'{len(d)} x {d[0].device_kind}')"
    try:
        result = subprocess.run([sys.executable, "-c", code], env=child_env(platform),
                                capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return None
    if result.returncode != 0 or not result.stdout.strip():
        return None
    return result.stdout.strip().splitlines()[-1]


def run_cell(args, platform: str, attention: str, extra: list[str]) -> dict:
    """One (platform, attention backend) run of bench_throughput in a child process."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, str(ROOT / "scripts" / "bench_throughput.py"),
               "--systems", "jaxpage", "--attention-backend", attention,
               "--out-dir", out, "--name", "cell", *extra]
        if args.no_progress:
            cmd.append("--no-progress")
        result = subprocess.run(cmd, env=child_env(platform), capture_output=True, text=True)
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            return {"status": "failed: " + " / ".join(tail)[:300]}
        payload = json.loads((Path(out) / "cell.json").read_text())
    row = payload["results"][0]
    return {"status": "ok", "device": payload["environment"]["device"],
            **{k: row[k] for k in ("requests_per_s", "output_tokens_per_s",
                                   "total_tokens_per_s", "wall_s")}}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--platforms", default="cpu,gpu,tpu",
                        help="which to try (absent ones are skipped)")
    parser.add_argument("--attention", default="kernel,reference")
    parser.add_argument("--out-dir", default="bench_results")
    parser.add_argument("--name", default="backends")
    parser.add_argument("--no-progress", action="store_true")
    args, extra = parser.parse_known_args(argv)
    args.platforms = [p for p in args.platforms.split(",") if p]
    args.attention = [{"pallas": "kernel"}.get(a, a) for a in args.attention.split(",") if a]
    bad = [p for p in args.platforms if p not in PLATFORMS] + \
          [a for a in args.attention if a not in ("kernel", "reference")]
    if bad:
        parser.error(f"unknown platform or attention path: {bad}")
    return args, extra


def main(argv=None) -> dict:
    """Extra arguments (``--model``, ``--workload``, ``--dtype``, ...) go to bench_throughput."""
    args, extra = parse_args(argv)
    rows = []
    for platform in args.platforms:
        kind = probe(platform)
        if kind is None:
            print(f"{platform}: not present, skipped", file=sys.stderr)
            continue
        for attention in args.attention:
            row = {"platform": platform, "attention": attention, "device": kind}
            if attention == "kernel" and platform not in KERNEL_BACKEND:
                row["status"] = "n/a (no attention kernel for this platform)"
            else:
                backend = KERNEL_BACKEND[platform] if attention == "kernel" else "reference"
                print(f"{platform} / {attention}: running", file=sys.stderr, flush=True)
                row.update(run_cell(args, platform, backend, extra))
            rows.append(row)
    if not rows:
        raise SystemExit("no JAX backend could be used")
    columns = [("platform", "platform"), ("device", "device"), ("attention", "attention"),
               ("status", "status"), ("requests_per_s", "requests/s"),
               ("output_tokens_per_s", "output tokens/s"),
               ("total_tokens_per_s", "total tokens/s"), ("wall_s", "wall s")]
    table = markdown_table(rows, columns)
    payload = {"benchmark": "backends", "environment": environment(),
               "throughput_args": extra, "results": rows}
    measured = [r for r in rows if r.get("status") == "ok"]

    def draw(ax):
        names = [f"{r['platform']} / {r['attention']}" for r in measured]
        ax.barh(names, [r["output_tokens_per_s"] for r in measured], color="#1f77b4")
        ax.set_xlabel("output tokens/s")
        ax.invert_yaxis()

    paths = write_report(args.out_dir, args.name, title="jaxpage across backends",
                         payload=payload, table=table,
                         notes="Arguments passed to bench_throughput.py: "
                               f"`{' '.join(extra) or '(defaults)'}`.",
                         plot=draw if measured else None)
    print(table)
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    return payload


if __name__ == "__main__":
    main()
