"""Starts ``tests/parallel/worker.py`` scenarios in subprocesses and reads their JSON."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

from tests.options import FEW_BUCKETS

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Small engine settings: a few buckets to compile, chunked prefill, multi-step decode.
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, block_size=8,
              num_kv_blocks=48, **FEW_BUCKETS)


def _command(scenario: str, args: dict) -> list[str]:
    return [sys.executable, "-m", "tests.parallel.worker", scenario, json.dumps(args)]


def _env(xla_cache: bool = True) -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    # the suite's persistent XLA cache: workers compile the same programs again and again.
    # Not for the processes of one jax.distributed job: one that loads a program while
    # another compiles it reaches the first collective far ahead (gloo's set-up timed out).
    import jax

    if xla_cache and jax.config.jax_compilation_cache_dir:
        env.setdefault("JAX_COMPILATION_CACHE_DIR", jax.config.jax_compilation_cache_dir)
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                       str(jax.config.jax_persistent_cache_min_compile_time_secs))
    return env


def _result(stdout: str) -> dict:
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError("worker printed no RESULT line")


def run_worker(scenario: str, args: dict, timeout: float = 900) -> dict:
    proc = subprocess.run(_command(scenario, args), cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"worker {scenario} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return _result(proc.stdout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(scenario: str, args_list: list[dict], timeout: float = 900) -> list[dict | None]:
    """Start one worker per args at once (processes of one jax.distributed job)."""
    procs = [subprocess.Popen(_command(scenario, args), cwd=ROOT, env=_env(xla_cache=False),
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for args in args_list]
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                raise AssertionError(f"worker {scenario} failed ({proc.returncode}):\n"
                                     f"{stdout[-3000:]}\n{stderr[-6000:]}")
            results.append(_result(stdout) if "RESULT " in stdout else None)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results
