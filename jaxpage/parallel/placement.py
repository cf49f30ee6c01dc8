"""Placement: where one model replica's arrays live, and how its programs are jitted.

A ``Placement`` wraps the replica's ``Mesh`` (one axis, ``tp``) or None for the plain
single-device path, which then runs exactly as without this module. It knows the
sharding of every parameter (``sharding_rules``) and of the KV cache, loads host arrays
straight into their shards, and jits the model's programs so that the KV cache keeps its
sharding (it is donated in and out) and small outputs come back replicated.

Several processes (``jax.distributed``): the mesh spans devices this process cannot
address. Inputs made on the host are then turned into global replicated arrays, and
replicated outputs are read from this process's own copy, so callers keep using
``np.asarray`` on the results.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpage.parallel.sharding_rules import KV_CACHE_SPEC, QUANTIZED_PARTS, TP, param_spec


def build_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A one-axis (``tp``) mesh over ``devices``, in the given order."""
    return Mesh(np.array(list(devices)), (TP,))


def replica_meshes(tensor_parallel_size: int, data_parallel_size: int) -> list[Mesh]:
    """One mesh per data-parallel replica, over disjoint consecutive groups of devices.

    ``jax.devices()`` lists every process's devices (process 0's first), so a group may
    span processes: that is how a tensor-parallel group crosses hosts.
    """
    devices = jax.devices()
    needed = tensor_parallel_size * data_parallel_size
    if len(devices) < needed:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size="
                         f"{data_parallel_size} needs {needed} devices; only {len(devices)} "
                         f"{jax.default_backend()} device(s) are visible")
    return [build_mesh(devices[r * tensor_parallel_size:(r + 1) * tensor_parallel_size])
            for r in range(data_parallel_size)]


def _path_name(path: tuple) -> str:
    """The parameter name of a pytree path: its last dict / attribute key; for a part of a
    quantized weight, ``"{param}.{part}"`` (``sharding_rules.param_spec``)."""
    keys = [key for key in (getattr(entry, "key", getattr(entry, "name", None))
                            for entry in path) if isinstance(key, str) and key != "value"]
    if not keys:
        raise ValueError(f"cannot name the parameter at path {path}")
    if keys[-1] in QUANTIZED_PARTS and len(keys) > 1:
        return f"{keys[-2]}.{keys[-1]}"
    return keys[-1]


class Placement:
    """Shardings of one replica on ``mesh`` (None: one device, nothing is sharded)."""

    def __init__(self, mesh: Mesh | None) -> None:
        self.mesh = mesh
        self._multi_process = mesh is not None and any(
            d.process_index != jax.process_index() for d in mesh.devices.flat)

    @property
    def tp_size(self) -> int:
        return 1 if self.mesh is None else int(self.mesh.shape[TP])

    @property
    def multi_process(self) -> bool:
        return self._multi_process

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    @property
    def replicated(self) -> NamedSharding:
        return self.sharding(P())

    def put_replicated(self, value: Any) -> jax.Array:
        """A host array put on every device of the mesh (or the default one); a transfer,
        no program."""
        if self.mesh is None:
            return jax.device_put(value)
        return jax.device_put(value, self.replicated)

    def zeros_replicated(self, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        """A zero array with a full copy on every device of the mesh (or the default one)."""
        if self.mesh is None:
            return jax.numpy.zeros(shape, dtype)
        return jax.jit(lambda: jax.numpy.zeros(shape, dtype), out_shardings=self.replicated)()

    @property
    def kv_sharding(self) -> NamedSharding | None:
        return None if self.mesh is None else self.sharding(KV_CACHE_SPEC)

    def param_sharding(self, name: str, shape: tuple[int, ...]) -> NamedSharding:
        return self.sharding(param_spec(name, shape, self.tp_size))

    def state_shardings(self, state: Any) -> Any:
        """A tree like ``state`` (arrays or shape structs) of each leaf's NamedSharding."""
        return jax.tree_util.tree_map_with_path(
            lambda path, leaf: self.param_sharding(_path_name(path), tuple(leaf.shape)), state)

    def put(self, name: str, array: np.ndarray, dtype: Any) -> jax.Array:
        """A host array into its shards: each device receives only its own slice.

        ``jax.make_array_from_callback`` asks for the slices of this process's devices,
        so no device (and no process) ever holds more than its share.
        """
        sharding = self.param_sharding(name, array.shape)
        return jax.make_array_from_callback(
            array.shape, sharding, lambda index: np.asarray(array[index], dtype=dtype))

    def global_input(self, value: Any) -> Any:
        """Host or single-device arrays -> arrays replicated over the mesh."""
        if self.mesh is None:
            return value
        sharding = self.replicated
        if not self.multi_process:
            return jax.device_put(value, sharding)
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), value)

    def local_output(self, value: Any) -> Any:
        """Replicated outputs -> this process's copy (np.asarray works on it)."""
        if not self.multi_process:
            return value
        return jax.tree.map(lambda x: x.addressable_data(0), value)

    def jit(self, fn: Callable, *, donate_argnums: tuple[int, ...] = (),
            carry_sharding: Any = None,
            compiler_options: dict[str, Any] | None = None) -> Callable:
        """``jax.jit`` for ``fn(state, kv_cache, *inputs) -> (kv_cache, *outputs)``.

        On a mesh the KV cache keeps its KV-head sharding through the program (so the
        donated buffers are reused) and every other output is replicated; inputs made
        on the host are placed replicated first, and outputs are read back locally
        (``global_input`` / ``local_output``). ``carry_sharding``: the sharding (pytree
        prefix) of the second argument when it is not just the KV cache.
        ``compiler_options``: XLA options for this program (``jax.jit``'s).
        """
        if self.mesh is None:
            return jax.jit(fn, donate_argnums=donate_argnums, compiler_options=compiler_options)
        replicated = self.replicated
        kv_sharding = self.kv_sharding if carry_sharding is None else carry_sharding

        def constrained(state, kv_cache, *inputs):
            kv_cache = jax.lax.with_sharding_constraint(kv_cache, kv_sharding)
            kv_cache, *outputs = fn(state, kv_cache, *inputs)
            return (jax.lax.with_sharding_constraint(kv_cache, kv_sharding),
                    *jax.lax.with_sharding_constraint(tuple(outputs), replicated))

        jitted = jax.jit(constrained, donate_argnums=donate_argnums,
                         compiler_options=compiler_options)

        def run(state, kv_cache, *inputs):
            kv_cache, *outputs = jitted(state, kv_cache, *self.global_input(inputs))
            return (kv_cache, *self.local_output(tuple(outputs)))

        run.jitted = jitted  # for lowering / inspection
        run.place_inputs = lambda state, kv, *inputs: (state, kv, *self.global_input(inputs))
        return run


def default_mesh(parallel: Any) -> Mesh | None:
    """Replica 0's mesh for a ``ParallelConfig``; None for one device in one process."""
    if parallel.tensor_parallel_size == 1 and parallel.num_processes == 1:
        return None
    return replica_meshes(parallel.tensor_parallel_size, 1)[0]
