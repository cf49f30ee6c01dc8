"""More than one process: ``jax.distributed`` start-up and the leader / follower mirror.

Every process runs the same command. ``initialize`` joins them (before JAX touches a
device); then each builds the same engine the same way, so the start-up programs (weight
placement, KV cache allocation) run in step on every process. After that only process 0
(the leader) schedules. Its ``ModelRunner`` is wrapped in ``MirroredRunner``: each public
method call (``execute``, ``execute_multi_step``, ``apply_block_ops``, ...) is first
broadcast to the followers as ``(name, args, kwargs)``, then run. A follower sits in
``follow``, receiving the calls and making the same ones on its own runner, so every
process enters the same jitted programs with the same inputs, which is what a
multi-controller JAX program needs. ``stop_followers`` (at the leader's exit) ends them.

The broadcast is ``multihost_utils.broadcast_one_to_all`` over the devices: first the
payload's length, then the pickled payload padded to a power of two (few shapes, few
compiled programs). The payload is host data (numpy batches, block id lists).
"""

from __future__ import annotations

import atexit
import inspect
import logging
import pickle
from typing import Any

import jax
import numpy as np

logger = logging.getLogger("jaxpage")

_STOP = "__stop__"
_CALL = "__call__"  # a module-level function called with the runner (orbax save, ...)
_LOCAL_METHODS = frozenset({"measure_host_bandwidth"})  # no device program of the mesh


def initialize(parallel: Any) -> None:
    """``jax.distributed.initialize`` from a ``ParallelConfig`` (once; no-op for one process).

    On the CPU, cross-process collectives go through gloo.
    """
    if parallel.num_processes == 1 or is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=parallel.coordinator_address,
                               num_processes=parallel.num_processes,
                               process_id=parallel.process_id)
    logger.info("jax.distributed: process %d of %d, %d local / %d global devices",
                jax.process_index(), jax.process_count(), jax.local_device_count(),
                jax.device_count())


def is_initialized() -> bool:
    check = getattr(jax.distributed, "is_initialized", None)
    if check is not None:
        return bool(check())
    from jax._src import distributed as _distributed  # older jax: no public query

    return _distributed.global_state.client is not None


def is_leader() -> bool:
    return jax.process_index() == 0


def broadcast_bytes(payload: bytes | None) -> bytes:
    """Process 0's ``payload`` on every process (others pass None). A collective call."""
    from jax.experimental import multihost_utils

    source = is_leader()
    length = np.array([len(payload) if source else 0], np.int32)
    length = int(np.asarray(multihost_utils.broadcast_one_to_all(length, source))[0])
    size = max(1024, 1 << max(0, length - 1).bit_length())
    buffer = np.zeros(size, np.uint8)
    if source:
        buffer[:length] = np.frombuffer(payload, np.uint8)
    buffer = np.asarray(multihost_utils.broadcast_one_to_all(buffer, source))
    return buffer[:length].tobytes()


class MirroredRunner:
    """The leader's runner: public method calls are broadcast to the followers, then run.

    Attribute reads and writes go straight to the wrapped runner.
    """

    def __init__(self, runner: Any) -> None:
        object.__setattr__(self, "_runner", runner)
        object.__setattr__(self, "_stopped", False)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._runner, name)
        if name.startswith("_") or name in _LOCAL_METHODS or not inspect.ismethod(value):
            return value

        def mirrored(*args: Any, **kwargs: Any) -> Any:
            if self._stopped:
                raise RuntimeError("the follower processes were stopped; this engine can no "
                                   "longer run the model")
            broadcast_bytes(pickle.dumps((name, args, kwargs)))
            return value(*args, **kwargs)

        return mirrored

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._runner, name, value)

    def mirror_call(self, target: str, *args: Any) -> Any:
        """Run ``module:function(runner, *args)`` here and on every follower."""
        broadcast_bytes(pickle.dumps((_CALL, (target, *args), {})))
        return _resolve(target)(self._runner, *args)

    def stop_followers(self) -> None:
        """Tell every follower to leave ``follow`` (idempotent)."""
        if not self._stopped:
            object.__setattr__(self, "_stopped", True)
            broadcast_bytes(pickle.dumps((_STOP, (), {})))


def follow(runner: Any) -> int:
    """A follower's loop: make each call the leader broadcasts, until it stops us.

    Returns the number of calls made. An exception in a call is logged and the loop goes
    on (the leader, running the same call on the same inputs, raises it too).
    """
    calls = 0
    while True:
        name, args, kwargs = pickle.loads(broadcast_bytes(None))
        if name == _STOP:
            return calls
        try:
            if name == _CALL:
                _resolve(args[0])(runner, *args[1:])
            else:
                getattr(runner, name)(*args, **kwargs)
        except Exception:  # noqa: BLE001 - mirrored from the leader, which reports it
            logger.exception("follower: %s failed", name)
        calls += 1


def _resolve(target: str) -> Any:
    import importlib

    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def mirror_engine_runners(engine: Any) -> list[MirroredRunner]:
    """Wrap the runner of ``engine`` (or of each replica) for the leader; stop at exit."""
    engines = getattr(engine, "engines", [engine])
    mirrors = []
    for replica in engines:
        replica.runner = MirroredRunner(replica.runner)
        mirrors.append(replica.runner)
    for mirror in mirrors:
        atexit.register(mirror.stop_followers)
    return mirrors
