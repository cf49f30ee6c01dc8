"""Compiled device programs kept on disk, so a second start neither traces nor compiles.

JAX's persistent compilation cache skips XLA compilation but still traces and lowers
every program (about a second each for a model step). This cache stores the compiled
executables themselves (``jax.experimental.serialize_executable``), one file per program
(``core.batch.program_set.ProgramKey``: its ``file_name`` tells every variant and the bucket),
under a directory whose name fingerprints everything the programs depend on:
jax and jaxlib versions, the platform and its devices, the compiler's flags from the
environment (``XLA_FLAGS``, ``LIBTPU_INIT_ARGS``), the source code of ``jaxpage`` and
``pallas_kernels``, and the avals of the fixed arguments (params, KV cache). A changed
model, option or code gets a fresh directory; nothing stale is ever loaded. Files are
written atomically; one that cannot be read is recompiled and replaced.

Backends that cannot serialize an executable still work: the program stays in memory.

In memory, programs are shared by every cache of the process with the same fingerprint
and devices: a second engine of the same model, options and device (a notebook that
rebuilds its ``LLM``, a test suite) runs the first one's programs without tracing or
compiling. Sharing is as safe as the disk tier: the fingerprint names everything a
program depends on besides its arguments. ``clear_shared_programs()`` drops them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import jax

from jaxpage.core.batch.program_set import ProgramKey
from jaxpage.runtime import background_compile
from jaxpage.runtime.compiler_options import ENV_DECODE_DOT_MERGER
from pallas_kernels.dense_matmul import resolve_backend as dense_backend
from pallas_kernels.quantized_matmul import activation_quant
from pallas_kernels.quantized_matmul import resolve_backend as quantized_backend
from pallas_kernels.ragged_paged_attention.gpu_config import ENV_TUNING
from pallas_kernels.sampling import resolve_backend as sampling_backend

logger = logging.getLogger("jaxpage")

_PACKAGES = ("jaxpage", "pallas_kernels")

_persistent_cache_hits = [0]  # programs JAX's persistent compilation cache supplied

# (fingerprint, device ids, program key) -> compiled program, for every cache of the process
_SHARED_PROGRAMS: dict[tuple, Callable] = {}


def clear_shared_programs() -> None:
    """Forget the programs shared in memory (each cache keeps the ones it already holds)."""
    _SHARED_PROGRAMS.clear()


def _count_cache_hits(event: str, **_: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _persistent_cache_hits[0] += 1


jax.monitoring.register_event_listener(_count_cache_hits)


def _source_digest() -> str:
    """Hash of every Python and C++ source and header file of the packages the programs are
    built from, and of their JSON files (the GPU kernel's tuning table)."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[2]
    for package in _PACKAGES:
        for path in sorted([*(root / package).rglob("*.py"), *(root / package).rglob("*.cc"),
                            *(root / package).rglob("*.h"), *(root / package).rglob("*.json")]):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _avals(tree: Any) -> str:
    leaves, treedef = jax.tree.flatten(tree)
    shapes = [(tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", ""))) for x in leaves]
    return f"{treedef}|{shapes}"


COMPILER_FLAG_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", ENV_DECODE_DOT_MERGER)


def _tuning_digest() -> str:
    """What the GPU attention kernel's tilings are read from besides the committed table
    (which ``_source_digest`` covers): the file ``JAXPAGE_GPU_ATTENTION_TUNING`` names, by
    its contents (a program built under one tuning run is not another's)."""
    path = os.environ.get(ENV_TUNING)
    if not path:
        return ""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as error:
        return f"unreadable {path}: {error}"


def fingerprint(*fixed_args: Any, extra: str = "") -> str:
    """A digest of what every cached program depends on besides its own bucket."""
    import jaxlib

    devices = jax.devices()
    parts = [jax.__version__, jaxlib.__version__, jax.default_backend(),
             str([(d.platform, d.device_kind) for d in devices]), _source_digest(),
             # flags change the code XLA emits (an executable built under other flags
             # would be loaded as if it were this one: a tuning run compared nothing)
             *(f"{name}={os.environ.get(name, '')}" for name in COMPILER_FLAG_VARIABLES),
             _tuning_digest(),
             *(_avals(arg) for arg in fixed_args), extra]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def kernel_backends(dtype: Any, *, quantized: bool) -> str:
    """The kernel backends the programs call, as part of their fingerprint. Resolving the
    C++ CPU kernels builds and registers them (before any saved program that calls them
    is loaded); whether they could be is part of what the programs depend on."""
    kernels = f"sampling={sampling_backend()}|dense_matmul={dense_backend('auto', dtype)}"
    if quantized:
        kernels += f"|quantized_matmul={quantized_backend('auto', dtype)}"
        kernels += f"|w8a8={activation_quant.native_codes()}"
    return kernels


class ExecutableCache:
    """``get(key, jitted, args)`` returns the compiled program ``key`` names, built for
    those arguments.

    Lookup order: this cache, the programs shared in memory by the process's other
    caches of the same fingerprint and devices, then ``directory/<fingerprint>/`` and the
    key's ``file_name``, then compiling (and saving). ``directory=None`` keeps programs in
    memory only.
    """

    def __init__(self, directory: str | os.PathLike | None, fingerprint: str,
                 devices: list | None = None) -> None:
        self.directory = Path(directory, fingerprint) if directory is not None else None
        self._shared_key = (fingerprint, tuple(d.id for d in devices or ()))
        # The devices the programs run on; a loaded program would otherwise be placed on
        # every device of the backend.
        self.devices = devices
        self._programs: dict[ProgramKey, Callable] = {}
        self.num_loaded = 0      # programs read from disk
        self.num_compiled = 0    # programs traced and compiled in this process
        self.num_shared = 0      # programs another cache of the process had compiled
        self.num_prefetched = 0  # programs built on the background thread (``prefetch``)
        self._pending: dict[ProgramKey, Future] = {}  # queued background builds
        # Every compile here: (key, the thread that compiled it, seconds).
        self.compiles: list[tuple[ProgramKey, str, float]] = []
        self._platform = (devices[0].platform if devices else jax.default_backend())
        self._lock = threading.Lock()

    def get(self, key: ProgramKey, jitted: Any, args: tuple) -> Callable:
        program = self._programs.get(key)
        if program is None:
            with self._lock:
                future = self._pending.get(key)
            if future is not None:  # being built in the background: wait for it
                try:
                    program = future.result()
                except Exception as error:  # noqa: BLE001 - build it here instead
                    logger.info("background build of %s failed (%s); building it now",
                                key.file_name, error)
            if program is None:
                program = self._find_or_build(key, jitted, args)
            self._programs[key] = program
        return program

    def prefetch(self, key: ProgramKey, jitted: Any, args: tuple,
                 urgent: bool = False) -> bool:
        """Build the program for ``args`` on the background thread (``background_compile``)
        unless it is held or already on its way; ``get`` then waits for it instead of
        building it again. ``args`` may be ``jax.ShapeDtypeStruct``s (only their shapes,
        dtypes and shardings count). ``urgent``: before the queued builds that are not
        (a program queued already is queued again, urgently: whichever runs second finds it
        built). True when a build was queued."""
        with self._lock:
            if key in self._programs or (key in self._pending and not urgent):
                return False
            mine: list[Future] = []
            future = background_compile.submit(
                lambda: self._background_build(key, jitted, args, mine), urgent=urgent)
            mine.append(future)
            self._pending[key] = future
        return True

    def ensure(self, key: ProgramKey, jitted: Any, args: tuple) -> bool:
        """Make the program for ``args`` exist without running it: nothing to do when it is
        held, being built, shared by another cache of the process or saved on disk (a
        later ``get`` loads it); otherwise it is compiled now, saved and held. ``args``
        may be ``jax.ShapeDtypeStruct``s. True when it was compiled."""
        with self._lock:
            if key in self._programs or key in self._pending:
                return False
        path = self._path(key)
        if (*self._shared_key, key) in _SHARED_PROGRAMS or (path is not None and path.exists()):
            return False
        self._programs[key] = self._find_or_build(key, jitted, args)
        return True

    def _background_build(self, key: ProgramKey, jitted: Any, args: tuple,
                          mine: list[Future]) -> Callable:
        """A queued build (``mine``: its own future, once queued); it leaves ``_pending``
        unless a later request for the same program queued another build."""
        try:
            program = self._find_or_build(key, jitted, args)
            self._programs.setdefault(key, program)
            self.num_prefetched += 1
            return program
        finally:
            with self._lock:
                if key in self._programs or self._pending.get(key) in mine:
                    self._pending.pop(key, None)

    def _find_or_build(self, key: ProgramKey, jitted: Any, args: tuple) -> Callable:
        """The program shared in memory, else loaded from disk, else compiled (and saved)."""
        shared_key = (*self._shared_key, key)
        program = _SHARED_PROGRAMS.get(shared_key)
        if program is not None:
            self.num_shared += 1
            return program
        program = self._load(key) or self._compile(key, jitted, args)
        return _SHARED_PROGRAMS.setdefault(shared_key, program)

    def holds(self, key: ProgramKey) -> bool:
        """The program is built and held here (a call of it neither loads nor compiles)."""
        return key in self._programs

    def programs(self) -> dict[ProgramKey, Callable]:
        """The programs held in memory, by key: for inspection."""
        return dict(self._programs)

    def _path(self, key: ProgramKey) -> Path | None:
        return None if self.directory is None else self.directory / key.file_name

    def _load(self, key: ProgramKey) -> Callable | None:
        path = self._path(key)
        if path is None or not path.exists():
            return None
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            program = deserialize_and_load(payload, in_tree, out_tree,
                                           execution_devices=self.devices)
        except Exception as error:  # noqa: BLE001 - a bad file is recompiled, never fatal
            logger.warning("recompiling %s: cached executable unreadable (%s)", path.name, error)
            return None
        self.num_loaded += 1
        return program

    def _compile(self, key: ProgramKey, jitted: Any, args: tuple) -> Callable:
        hits = _persistent_cache_hits[0]
        began = time.perf_counter()
        compiled = jitted.lower(*args).compile()
        self.num_compiled += 1
        self.compiles.append((key, threading.current_thread().name,
                              time.perf_counter() - began))
        path = self._path(key)
        # An executable that XLA's persistent cache handed back serializes without its code
        # on the CPU (jax 0.10: "Function ... not found" when the copy runs). Hits are not
        # always reported to this process, so on the CPU nothing is saved while that cache
        # is on. GPU and TPU executables carry their code (the persistent cache itself
        # stores them serialized), so there both caches are kept.
        unsafe = self._platform == "cpu" and (bool(jax.config.jax_compilation_cache_dir)
                                              or _persistent_cache_hits[0] != hits)
        if path is not None and not unsafe:
            self._save(path, compiled)
        return compiled

    def _save(self, path: Path, compiled: Any) -> None:
        from jax.experimental.serialize_executable import serialize

        try:
            payload = pickle.dumps(serialize(compiled))
        except Exception as error:  # noqa: BLE001 - some backends cannot serialize
            logger.info("executable not cached on disk (%s); it stays in memory", error)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".tmp{os.getpid()}")
        temporary.write_bytes(payload)
        os.replace(temporary, path)


class JitPrograms:
    """Stands in for ``ExecutableCache`` on a mesh: ``get`` returns the jitted function
    itself, so every call goes through ``jax.jit`` dispatch, which places host-made inputs on the mesh and
    caches the compiled program per shape. It holds nothing, so it has no ``holds``,
    ``prefetch`` or ``ensure``: a program is built by running it."""

    directory = None
    num_loaded = 0
    num_compiled = 0

    def get(self, key: ProgramKey, jitted: Callable, args: tuple) -> Callable:
        return jitted
