"""Build and load the hand-written C++ CPU kernels (XLA FFI custom calls), once per machine.

A kernel's source is compiled on first use with the system C++ compiler against the XLA
FFI headers that jaxlib ships (``jax.ffi.include_dir()``) and this package's shared
headers (``_cpu_parallel.h``), with ``-march=native``. The shared library is cached under
``$JAXPAGE_CACHE_DIR/cpu_kernels`` (default ``~/.cache/jaxpage``), keyed by the source,
the shared headers, the compiler command, jaxlib's version and this CPU's feature flags,
so a library built for another CPU is never loaded.

When no compiler is found, the build fails, or ``JAXPAGE_CPU_KERNELS=0`` is set,
``load`` returns None and callers fall back to their plain-jnp reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

# Never -ffast-math: it links crtfastmath, which flushes subnormals to zero for the whole
# process (numpy, torch and XLA included).
_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp-simd", "-shared", "-fPIC",
          "-std=c++17", "-w")
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def enabled() -> bool:
    """False when ``JAXPAGE_CPU_KERNELS`` is set to 0 / false / off."""
    return os.environ.get("JAXPAGE_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "off")


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_root() -> Path:
    root = os.environ.get("JAXPAGE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "jaxpage")
    return Path(root, "cpu_kernels")


def load(source: Path) -> ctypes.CDLL | None:
    """The compiled library of ``source`` (built now if not cached), or None if unavailable."""
    key = str(source)
    with _lock:
        if key not in _loaded:
            _loaded[key] = _build_and_load(source) if enabled() else None
        return _loaded[key]


_registered: set[str] = set()


def register(source: Path, targets: dict[str, str]) -> bool:
    """Build and load ``source``, and register its handlers with XLA as FFI targets
    (``{target name: exported symbol}``) for the CPU; idempotent. False if unavailable.

    Must run before any compiled program that calls them is loaded from disk.
    """
    key = str(source)
    with _lock:
        if key in _registered:
            return True
    library = load(source)
    if library is None:
        return False
    import jax.ffi

    with _lock:
        if key not in _registered:
            for target, symbol in targets.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                            platform="cpu")
            _registered.add(key)
    return True


def compiler() -> str | None:
    """The C++ compiler the kernels are built with (``$CXX``, else g++ or c++), or None."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _build_and_load(source: Path) -> ctypes.CDLL | None:
    compiler_path = compiler()
    if compiler_path is None:
        logger.warning("no C++ compiler found: using the plain-jnp reference for %s", source.name)
        return None
    import jax.ffi
    import jaxlib

    include = jax.ffi.include_dir()
    headers = Path(__file__).parent  # the kernels' shared headers (_cpu_parallel.h)
    digest = hashlib.sha256()
    for part in (source.read_bytes(), *(h.read_bytes() for h in sorted(headers.glob("*.h"))),
                 compiler_path.encode(), " ".join(_FLAGS).encode(), jaxlib.__version__.encode(),
                 _cpu_features().encode()):
        digest.update(part)
    target = _cache_root() / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        command = [compiler_path, *_FLAGS, f"-I{include}", f"-I{headers}", str(source), "-o", tmp]
        logger.info("compiling %s (once per machine)", source.name)
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            os.unlink(tmp)
            logger.warning("building %s failed, using the plain-jnp reference:\n%s",
                           source.name, result.stderr[-2000:])
            return None
        os.replace(tmp, target)  # atomic: concurrent builders never load a partial file
    return ctypes.cdll.LoadLibrary(str(target))
