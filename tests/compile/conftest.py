"""Compile tests build executables for devices that are not there: keep them out of the
suite's persistent compilation cache (JAX cannot load them back without the device)."""

import jax
import pytest
from jax._src import compilation_cache


@pytest.fixture(autouse=True, scope="package")
def _no_persistent_cache_for_deviceless_programs():
    # JAX decides at the first compile after a reset whether the persistent cache is used,
    # and keeps that answer until the next reset; so reset on both sides. Without the
    # reset here, a process that compiled elsewhere first (pytest-xdist hands a worker
    # this package's files between others, setting this fixture up more than once) kept
    # using the cache for deviceless programs. Without the reset after, the rest of the
    # suite ran with no persistent cache at all.
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", enabled)
    compilation_cache.reset_cache()
