"""Running disaggregated serving: the proxy alone, or ``--disaggregated NPMD`` (N prefill
and M decode ``jaxpage serve`` processes on this host plus the proxy, for trying it)."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import uvicorn

from jaxpage.server.launch import free_port
from jaxpage.server.proxy.app import build_proxy_app


def run_proxy(prefill: list[str], decode: list[str], *, host: str = "127.0.0.1",
              port: int = 8000, log_level: str = "info", max_imbalance: int = 8) -> None:
    """Check the instances' KV layouts, then serve the proxy until interrupted."""
    if max_imbalance < 0:
        raise ValueError(f"max_imbalance={max_imbalance} must be >= 0")
    check_kv_layouts(prefill, decode)
    uvicorn.run(build_proxy_app(prefill, decode, max_imbalance=max_imbalance), host=host,
                port=port, log_level=log_level)


def check_kv_layouts(prefill: list[str], decode: list[str],
                     client: httpx.Client | None = None) -> None:
    """ValueError unless every instance has its role and they all lay KV pages out alike
    (layers, block size, KV heads and head size, dtype, devices the heads are split over):
    pages of a prefill instance must fit every decode instance. Instances that cannot be
    reached are left to the requests (they answer 503)."""
    client = client or httpx.Client(timeout=10)
    layouts = {}
    for role, urls in (("prefill", prefill), ("decode", decode)):
        for url in urls:
            try:
                response = client.get(url.rstrip("/") + "/kv_layout")
            except httpx.HTTPError:
                continue
            if response.status_code != 200:
                continue
            layout = response.json()
            if layout.get("kv_role") != role:
                raise ValueError(f"{url} was given as a {role} instance but was started with "
                                 f"kv_role={layout.get('kv_role')!r}")
            layouts[url] = {k: v for k, v in layout.items() if k != "kv_role"}
    if len({tuple(sorted(layout.items())) for layout in layouts.values()}) > 1:
        described = "; ".join(f"{url}: {layout}" for url, layout in layouts.items())
        raise ValueError("the instances lay KV pages out differently, so a prefill "
                         f"instance's pages would not fit a decode instance: {described}. "
                         "Start every instance with the same model, dtype, kv_cache_dtype, "
                         "block_size and tensor_parallel_size")


def parse_layout(text: str) -> tuple[int, int]:
    """"1P1D" -> (1, 1): prefill and decode instances to start."""
    match = re.fullmatch(r"(\d+)P(\d+)D", text.strip(), re.IGNORECASE)
    if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise ValueError(f"--disaggregated={text!r} must look like 1P1D (>= 1 of each)")
    return int(match.group(1)), int(match.group(2))


PARENT_ENV = "JAXPAGE_DIE_WITH_PARENT"  # the pid whose death stops this instance


def die_with_parent() -> None:
    """In an instance started by ``start_instance``: get SIGTERM when the starting process
    dies (Linux), so instances never outlive a proxy stopped by a signal (uvicorn re-raises
    it after shutting down, before any ``finally`` of ours runs). Called by the instance
    itself at start-up: a ``preexec_fn`` would run in a fork of a multithreaded process."""
    parent = os.environ.get(PARENT_ENV)
    if parent is None or sys.platform != "linux":
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != int(parent):  # the parent died before the call above
        os.kill(os.getpid(), signal.SIGTERM)


def start_instance(args: list[str], role: str, port: int, env: dict | None = None
                   ) -> subprocess.Popen:
    """``jaxpage serve <args> --kv-role role --port port`` as a child process."""
    command = [sys.executable, "-m", "jaxpage.cli", "serve", *args, "--kv-role", role,
               "--port", str(port), "--log-level", "warning"]
    return subprocess.Popen(command, env={**os.environ, **(env or {}),
                                          PARENT_ENV: str(os.getpid())})


def wait_healthy(urls: list[str], processes: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        if any(p.poll() is not None for p in processes):
            raise RuntimeError("an instance exited during start-up")
        if time.monotonic() > deadline:
            raise RuntimeError(f"instances not healthy after {timeout_s:.0f} s: {pending}")
        try:
            if httpx.get(pending[0] + "/health", timeout=2).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def serve_disaggregated(layout: str, instance_args: list[str], *, host: str, port: int,
                        log_level: str = "info", start_timeout_s: float = 600.0,
                        **_: Any) -> None:
    """Start the instances of ``layout`` on free loopback ports, then the proxy on
    ``host:port``; stop the instances when the proxy stops."""
    num_prefill, num_decode = parse_layout(layout)
    processes, prefill, decode = [], [], []
    try:
        for role, count, urls in (("prefill", num_prefill, prefill), ("decode", num_decode, decode)):
            for _ in range(count):
                instance_port = free_port()
                processes.append(start_instance(instance_args, role, instance_port))
                urls.append(f"http://127.0.0.1:{instance_port}")
        wait_healthy(prefill + decode, processes, start_timeout_s)
        run_proxy(prefill, decode, host=host, port=port, log_level=log_level)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
