"""Compile tests build executables for devices that are not there: keep them out of the
suite's persistent compilation cache (JAX cannot load them back without the device)."""

import jax
import pytest
from jax._src import compilation_cache


@pytest.fixture(autouse=True, scope="package")
def _no_persistent_cache_for_deviceless_programs():
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", enabled)
    # JAX decides once, at the first compile of the process, whether the persistent cache
    # is used, and keeps that answer: this package runs first, so without a reset the rest
    # of the suite ran with no persistent cache at all.
    compilation_cache.reset_cache()
