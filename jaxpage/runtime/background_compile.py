"""One background thread that builds (loads or compiles) device programs ahead of need.

The engine asks for programs it predicts (``ExecutableCache.prefetch``): the decode
programs of the smaller batches a running workload drains into. Building them here,
while the device runs the current call, takes their tracing and XLA compilation off the
step that first needs them; on an accelerator the host is otherwise idle then, and on the
CPU the compiler fills the cores the step leaves idle.

Invariants: jobs run one at a time in submission order; a job's failure is kept in its
future (the caller then builds the program itself) and never stops the worker; at
interpreter exit the queued jobs are dropped and only the build under way is waited for.
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_jobs: "queue.SimpleQueue[tuple[Future, Callable[[], Any]] | None]" = queue.SimpleQueue()
_worker: threading.Thread | None = None
_start_lock = threading.Lock()
_closing = threading.Event()


def submit(build: Callable[[], Any]) -> Future:
    """Run ``build()`` on the background thread; its result (or error) in the future."""
    global _worker
    future: Future = Future()
    if _closing.is_set():
        future.cancel()
        return future
    with _start_lock:
        if _worker is None or not _worker.is_alive():
            _worker = threading.Thread(target=_run, name="jaxpage-compile", daemon=True)
            _worker.start()
    _jobs.put((future, build))
    return future


def _run() -> None:
    while True:
        job = _jobs.get()
        if job is None or _closing.is_set():
            return
        future, build = job
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(build())
        except BaseException as error:  # noqa: BLE001 - kept for the caller
            future.set_exception(error)


@atexit.register
def _stop() -> None:
    """Drop the queued jobs and let the worker finish the one it is on: a daemon thread
    still inside the compiler when the interpreter finalizes aborts the process."""
    _closing.set()
    _jobs.put(None)
    if _worker is not None:
        _worker.join(timeout=600)
