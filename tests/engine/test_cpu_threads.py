"""The CPU backend's compute threads yield to the host loop (``runtime.cpu_threads``)."""

import os
import sys
import threading

import jax
import jax.numpy as jnp
import pytest

from jaxpage.config import SchedulerConfig
from jaxpage.runtime.cpu_threads import XLA_COMPUTE_THREAD, lower_compute_threads

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="per-thread nice values are a Linux feature")


def _niceness_by_thread() -> dict[int, tuple[str, int]]:
    out = {}
    for task in os.listdir("/proc/self/task"):
        try:
            name = open(f"/proc/self/task/{task}/comm").read().strip()
            out[int(task)] = (name, os.getpriority(os.PRIO_PROCESS, int(task)))
        except OSError:
            continue  # ended meanwhile
    return out


def test_only_xla_compute_threads_are_lowered():
    (jnp.ones((64, 64)) @ jnp.ones((64, 64))).block_until_ready()  # XLA's pool exists
    assert jax.default_backend() == "cpu"
    main = threading.get_native_id()
    main_before = os.getpriority(os.PRIO_PROCESS, main)
    lower_compute_threads(2)
    after = _niceness_by_thread()
    compute = [nice for name, nice in after.values() if name == XLA_COMPUTE_THREAD]
    assert compute and all(nice >= 2 for nice in compute)
    assert os.getpriority(os.PRIO_PROCESS, main) == main_before
    # Threads already at or above the value are left alone: nothing is lowered again.
    assert lower_compute_threads(1) == []
    assert lower_compute_threads(0) == []


@pytest.mark.parametrize("bad", [-1, 20, True, 2.5, "5"])
def test_bad_niceness_is_a_value_error(bad):
    with pytest.raises(ValueError, match=f"niceness={bad!r}"):
        lower_compute_threads(bad)
    with pytest.raises(ValueError, match="cpu_compute_niceness"):
        SchedulerConfig(cpu_compute_niceness=bad)


def test_without_proc_nothing_changes(tmp_path):
    assert lower_compute_threads(5, tasks=tmp_path / "missing") == []


def test_engine_lowers_them_to_its_setting(tiny_llm):
    # ``tiny_llm`` is an engine on the CPU backend with the default setting (10).
    assert tiny_llm.llm_engine.config.scheduler.cpu_compute_niceness == 10
    compute = [nice for name, nice in _niceness_by_thread().values()
               if name == XLA_COMPUTE_THREAD]
    assert compute and all(nice >= 10 for nice in compute)
