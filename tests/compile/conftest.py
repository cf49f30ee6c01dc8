"""Compile tests build executables for devices that are not there: keep them out of the
suite's persistent compilation cache (JAX cannot load them back without the device)."""

import jax
import pytest


@pytest.fixture(autouse=True, scope="package")
def _no_persistent_cache_for_deviceless_programs():
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", enabled)
