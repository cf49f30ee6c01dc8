"""One background thread that builds (loads or compiles) device programs ahead of need.

The engine asks for programs it predicts (``ExecutableCache.prefetch``): the decode
programs of the smaller batches a running workload drains into. Building them here,
while the device runs the current call, takes their tracing and XLA compilation off the
step that first needs them; on an accelerator the host is otherwise idle then, and on the
CPU the compiler fills the cores the step leaves idle.

Invariants: jobs run one at a time, urgent ones first (a program a batch wants now,
``urgent=True``), each kind in submission order; a job's failure is kept in its future
(the caller then builds the program itself) and never stops the worker; at interpreter
exit the queued jobs are dropped and only the build under way is waited for.
"""

from __future__ import annotations

import atexit
import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

# (priority, order, future, build): 0 urgent, 1 the rest; None (priority 2) stops the worker
_jobs: "queue.PriorityQueue[tuple]" = queue.PriorityQueue()
_order = itertools.count()
_worker: threading.Thread | None = None
_start_lock = threading.Lock()
_closing = threading.Event()


def submit(build: Callable[[], Any], urgent: bool = False) -> Future:
    """Run ``build()`` on the background thread (before every job not ``urgent`` still
    queued, when ``urgent``); its result (or error) in the future."""
    global _worker
    future: Future = Future()
    if _closing.is_set():
        future.cancel()
        return future
    with _start_lock:
        if _worker is None or not _worker.is_alive():
            _worker = threading.Thread(target=_run, name="jaxpage-compile", daemon=True)
            _worker.start()
    _jobs.put((0 if urgent else 1, next(_order), future, build))
    return future


def _run() -> None:
    while True:
        _, _, future, build = _jobs.get()
        if future is None or _closing.is_set():
            return
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
    _jobs.put((2, next(_order), None, None))
    if _worker is not None:
        _worker.join(timeout=600)
