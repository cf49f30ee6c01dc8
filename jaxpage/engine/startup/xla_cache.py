"""The platform the engine runs on, and JAX's persistent compilation cache for it."""

from __future__ import annotations

import logging

logger = logging.getLogger("jaxpage")


def jax_backend() -> str:
    """JAX's default backend: "cpu", "gpu" or "tpu"."""
    import jax

    return jax.default_backend()


def use_xla_cache(directory: str) -> None:
    """On an accelerator, turn on JAX's persistent compilation cache in ``directory`` unless
    one is set already (``JAX_COMPILATION_CACHE_DIR``): what the executable cache does not
    hold (a mesh's programs, a draft model's) then loads at the next start instead of
    compiling. On the CPU the executable cache alone is used: an executable XLA:CPU's
    cache handed back cannot be saved by it (``runtime.executable_cache``)."""
    import jax

    if jax_backend() == "cpu" or jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", directory)
    logger.info("JAX compilation cache: %s", directory)
