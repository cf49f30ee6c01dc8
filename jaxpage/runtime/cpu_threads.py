"""The host loop ahead of the CPU backend's compute threads.

On the CPU backend the "device" is this machine's cores: XLA runs each call's work on
its intra-op thread pool (threads named ``tf_XLAEigen``, one per core; the C++ kernels
share it). With overlapped scheduling that work runs while the engine's host loop builds
the next call, and at equal priority the two share the cores: on this project's 2-core
machine the host's work between calls took 1.2-1.5x as long as alone, and a jitted call
~8x as long while a long computation held both cores. The host loop is the critical
path (while it runs late, the device's queue runs dry), so the engine lowers the
priority of XLA's compute threads: Linux's scheduler then hands a core to the host
thread as soon as it is runnable, and the compute threads get every cycle it leaves.
The computations' own work is unchanged; only who waits when both want a core.

A thread's nice value can only be raised without privileges, so the change lasts for
the process; it touches only XLA's compute threads (never Python's own threads).
Where ``/proc/self/task`` or ``os.setpriority`` is missing (not Linux), nothing changes.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

XLA_COMPUTE_THREAD = "tf_XLAEigen"  # the name XLA's CPU client gives its intra-op threads


def lower_compute_threads(niceness: int, tasks: Path = Path("/proc/self/task")) -> list[int]:
    """Give this process's XLA CPU compute threads a nice value of at least ``niceness``
    (0..19; 0 changes nothing). Returns the thread ids changed. Threads already at or
    above it, threads that ended meanwhile and refusals of the OS are skipped."""
    if not isinstance(niceness, int) or isinstance(niceness, bool) or not 0 <= niceness <= 19:
        raise ValueError(f"niceness={niceness!r} must be an integer in 0..19")
    if niceness == 0 or not hasattr(os, "setpriority") or not tasks.is_dir():
        return []
    changed = []
    for task in tasks.iterdir():
        try:
            if (task / "comm").read_text().strip() != XLA_COMPUTE_THREAD:
                continue
            tid = int(task.name)
            if os.getpriority(os.PRIO_PROCESS, tid) >= niceness:
                continue
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
            changed.append(tid)
        except (OSError, ValueError):
            continue  # the thread ended while we looked, or the OS refused
    if changed:
        logger.info("XLA CPU compute threads %s now at nice %d (the host loop first)",
                    changed, niceness)
    return changed
